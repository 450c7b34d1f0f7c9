"""The deliberate bugs that matter, each put into a scratch copy of HEAD one at a time,
and the tests that must catch it: a check that those tests still would.

    .venv/bin/python contrib/dev/mutants.py [--list] [INDEX ...]

Each bug is one exact text replacement in one file (it must match once, or the script
says the code moved and the bug must be rewritten); the tests named with it run in a
git worktree of HEAD (under the system temp dir, removed at the end) with this venv's
Python and PYTHONPATH set to the worktree, so that daemons and workers spawned by the
tests run the bugged code too. Exit 1 if any bug survives its tests. Not run by CI: the
whole list takes about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


SUPERVISION = "tests/integration/test_supervision.py"
DRAIN_SERVICE = "tests/drain/test_drain_service.py"
MUTANTS = (
    Mutant("the commit decision sent before it is saved",
           "mlxceld/cluster/assignment/coordinator_round.py",
           'return [Persist("commit"), *self._send("commit")]',
           'return [*self._send("commit"), Persist("commit")]',
           ("tests/integration/test_bringup_crash.py::test_the_coordinator_killed_at_commit_"
            "then_at_activate_and_a_committed_peer_end_active",)),
    Mutant("an API key with characters after the real one", "mlxceld/api/edge/auth.py",
           "hmac.compare_digest(offered, expected)",
           "hmac.compare_digest(offered[:len(expected)], expected)",
           ("tests/api/test_openai_client.py",)),
    Mutant("an API key ending with the real one", "mlxceld/api/edge/auth.py",
           "hmac.compare_digest(offered, expected)", "offered.endswith(expected)",
           ("tests/api/test_openai_client.py",)),
    Mutant("the handshake accepting only the primary key id", "mlxceld/wire/handshake.py",
           "secret = self._keyring.get(head.key_id)",
           "secret = self._keyring.primary if head.key_id == self._keyring.primary_id "
           "else None",
           ("tests/wire/test_connection.py", "tests/integration/test_agent.py")),
    Mutant("a second SIGTERM/SIGINT no longer forcing shutdown", "mlxceld/daemon/root.py",
           "loop.add_signal_handler(sig, self._force)",
           "loop.add_signal_handler(sig, lambda: None)", (SUPERVISION,)),
    Mutant("no shutdown deadline", "mlxceld/daemon/root.py",
           "async with asyncio.timeout(deadline_s):", "async with asyncio.timeout(None):",
           (SUPERVISION,)),
    Mutant("the restart count reset by a daemon restart", "mlxceld/supervisor/service.py",
           "restarts=row.restarts if row else 0)", "restarts=0)", (SUPERVISION,)),
    Mutant("the OOM-kill counter never read", "mlxceld/supervisor/runner.py",
           "oom_after = exits.oom_kill_count()", "oom_after = None",
           ("tests/integration/test_oom_kill.py",)),
    Mutant("every SIGKILL labelled an OOM kill", "mlxceld/supervisor/runner.py",
           "grew = None if oom_before is None or oom_after is None else oom_after > oom_before",
           "grew = True", (SUPERVISION,)),
    Mutant("the control socket admitting any uid", "mlxceld/control/peercred.py",
           "creds.uid in (0, own_uid)", "creds.uid >= 0", ("tests/control/test_access.py",)),
    Mutant("the control socket refusing root", "mlxceld/control/peercred.py",
           "creds.uid in (0, own_uid)", "creds.uid == own_uid",
           ("tests/control/test_access.py",)),
    Mutant("tied splits going to the largest boundary", "mlxceld/cluster/plan/solver.py",
           "if least < 0 or c < least:", "if least < 0 or c <= least:",
           ("tests/cluster/test_planner.py",)),
    Mutant("nodes tied on memory chosen by name", "mlxceld/cluster/plan/solver.py",
           "key=lambda n: (-n.memory_usable_bytes, n.key))",
           "key=lambda n: (-n.memory_usable_bytes, n.node_id))",
           ("tests/cluster/test_planner.py",)),
    Mutant("temperature multiplying the logits", "mlxceld/engine/sampling.py",
           "scaled = logprobs * (1.0 / temp)", "scaled = logprobs * temp",
           ("tests/engine/test_definitions.py",)),
    Mutant("presence and frequency penalties counting the prompt's tokens",
           "mlxceld/engine/processors.py",
           "generated = tokens[len(tokens) - calls:] if calls else tokens[:0]",
           "generated = tokens",
           ("tests/engine/test_definitions.py",)),
    Mutant("a bare IPv4 address without a port left unredacted",
           "mlxceld/replicas/redaction.py",
           r'r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b",',
           r'r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})\b",',
           ("tests/replicas/test_routing.py",)),
    Mutant("two drains at once arming the latest deadline", "mlxceld/api/edge/draining.py",
           "first = min(deadlines, key=lambda d: d.deadline or 0.0)",
           "first = max(deadlines, key=lambda d: d.deadline or 0.0)",
           ("tests/api/test_draining.py",)),
    Mutant("one unreadable tool call dropped silently from a list", "mlxceld/api/tools/calls.py",
           "if not calls or len(calls) != len(items):", "if not calls:",
           ("tests/api/test_replies.py",)),
    Mutant("a second drain of a draining node not saved", "mlxceld/drain/service.py",
           'self._table.put(row)\n            self._events.append("drain.changed"',
           'self._events.append("drain.changed"', (DRAIN_SERVICE,)),
    Mutant("a second drain of a draining node keeping the old deadline and --force",
           "mlxceld/drain/service.py",
           "row = replace(old, deadline=deadline, force=force, updated_at=now,",
           "row = replace(old, updated_at=now,", (DRAIN_SERVICE,)),
    Mutant("a drain of a node nobody knows recorded (and soon drained)",
           "mlxceld/daemon/draining.py",
           "return self.service.drain(self._known_node(node), deadline_s, force)",
           "return self.service.drain(node or self._local_node(), deadline_s, force)",
           ("tests/integration/test_drain.py::test_a_drain_of_a_node_nobody_knows_is_refused_"
            "naming_it",)),
    Mutant("a heal planning one stage per host alive", "mlxceld/cluster/healer.py",
           "stages = stage_count(len(served.peers), len(candidates))",
           "stages = len(candidates)", ("tests/cluster/test_healer.py",)),
    Mutant("a heal's stage count the hosts alive, not the plan's", "mlxceld/cluster/healing.py",
           "return max(1, min(served, hosts))", "return max(1, hosts)",
           ("tests/cluster/test_healing.py",)),
    Mutant("a decode node checking each handoff blob against the bound alone",
           "mlxceld/replicas/handoffs.py",
           "expected.size += len(tensor.data)", "expected.size = len(tensor.data)",
           ("tests/replicas/test_disagg.py::test_a_handoff_whose_blobs_add_up_past_the_bound_"
            "is_refused_at_once",)),
    Mutant("a prefill/decode pair's refusal (a node busy or draining) failing the request, "
           "not falling back to a replica", "mlxceld/replicas/disagg.py",
           "except (HandoffUnsupported, EngineUnavailable) as exc:",
           "except HandoffUnsupported as exc:",
           ("tests/replicas/test_disagg.py::test_a_pair_that_refuses_before_the_first_token_"
            "falls_back_to_a_replica",)),
)


def run(mutant: Mutant, tree: Path) -> tuple[bool, str]:
    """Whether the tests fail with the bug in (caught), and the first failing test."""
    target = tree / mutant.path
    source = target.read_text()
    if source.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: {mutant.old!r} is not found once in {mutant.path}; "
                         "the code moved: rewrite this bug in contrib/dev/mutants.py")
    target.write_text(source.replace(mutant.old, mutant.new))
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
             *mutant.tests], cwd=tree, capture_output=True, text=True, timeout=1800,
            env={**os.environ, "PYTHONPATH": str(tree)})
    finally:
        target.write_text(source)
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    return result.returncode != 0, failed[0] if failed else result.stdout[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    parser.add_argument("index", nargs="*", type=int, help="only these (from --list)")
    args = parser.parse_args()
    if args.list:
        for i, m in enumerate(MUTANTS):
            print(f"{i:2d}  {m.name}  ({m.path}; {', '.join(m.tests)})")
        return 0
    chosen = [MUTANTS[i] for i in args.index] if args.index else list(MUTANTS)
    survived = 0
    with tempfile.TemporaryDirectory(prefix="mutants") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach",
                        str(tree), "HEAD"], check=True)
        try:
            for m in chosen:
                start = time.monotonic()
                caught, detail = run(m, tree)
                survived += not caught
                print(f"{'caught  ' if caught else 'SURVIVED'} {m.name} "
                      f"({time.monotonic() - start:.0f} s): {detail}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(tree)], check=False)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
