"""A 2 x 2 mesh on real daemons (issue 32, inside each host): `--pp-auto 2` on a coordinator
and two `--pp-peer --tp-size 2` stage hosts (127.0.0.1/.2/.3), each stage host running its
stage as a tensor-parallel group of two ranks on its own loopback (worker ``stage`` rank 0,
``stage-tp-1`` rank 1): four ranks in all. Its greedy completions through the `openai`
client are mlx-lm's on the whole model, a conversation's turns too, each turn started from
the last one's KV on every rank of each stage (its prompt cache, rank 0 deciding and its
follower mirroring); `mlxctl status` on a stage host shows the group;
a follower killed with SIGKILL restarts its group (the supervisor's rule, naming the
follower) and the pipeline serves again; a re-activate stops each tensor stage
before the new plan's loads (no ``stage-retiring`` for a group yet) and serves again."""

from __future__ import annotations

import json
import os
import secrets
import signal
from pathlib import Path
from typing import Any

import openai
import pytest

from helpers.cluster import agent, start
from helpers.daemons import READY_S, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.mesh import complete, running_worker
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import growing_prompt
from helpers.waiting import wait_for

# Bring-up of five model processes and a router on a loaded 2-core machine, and a group's
# restart (backoff, two imports, the ring, each rank's load, the router's re-dial and
# replay hold). Bounds on waiting, not what is asserted about time.
UP_S = 180.0
BACK_S = 120.0
MEMBERS = ("stage", "stage-tp-1")


def pids(d: DaemonProc) -> dict[str, int | None]:
    """Each member of the stage's group: its pid while it runs, else None."""
    workers = {w["name"]: w for w in d.status()["workers"]}
    return {n: workers[n]["pid"] if n in workers and workers[n]["state"] == "running"
            else None for n in MEMBERS}


def running(daemons: Daemons, d: DaemonProc, bound: float,
            before: dict[str, int] | None = None) -> dict[str, int]:
    """Both members running (as new processes, when ``before`` is given)."""
    got: dict[str, int] = wait_for(
        lambda: (p := pids(d)) and all(p.values())
        and (before is None or all(p[n] != before[n] for n in MEMBERS)) and p,
        bound, f"stage and stage-tp-1 running on {d.root} (were {before})", every=0.3)
    daemons.pids |= set(got.values())
    return got

def caches_agree(d: DaemonProc) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Rank 0's prompt cache stats (once it had 2 hits) and the follower's, when the
    follower holds as many entries and bytes as rank 0 (each as last reported)."""
    leader, follower = running_worker(d, "stage"), running_worker(d, "stage-tp-1")
    if not leader or not follower:
        return None
    cache = (leader.get("stats") or {}).get("prompt_cache") or {}
    held = ((follower.get("stats") or {}).get("tensor") or {}).get("prompt_cache") or {}
    if cache.get("hits") != 2:
        return None
    return (cache, held) if held == {"entries": cache.get("entries"),
                                     "bytes": cache.get("bytes")} else None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pipeline_of_two_tensor_parallel_stages_serves_mlx_lms_tokens_and_heals(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--tp-size", "2",
                   "--model", str(model), name=f"p{i}") for i in (2, 3)]
    port = free_port("127.0.0.1")
    coord = daemons.make(name="c")
    coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                "--agent-addr", f"127.0.0.1:{free_port('127.0.0.1')}",
                "--cluster-peers", ",".join(agent(p) for p in peers), "--pp-auto", "2",
                "--model", str(model), "--port", str(port))
    wait_for(lambda: (coord.status().get("bringup") or {}).get("state") in ("active", "failed"),
             UP_S, "the push to end\n" + coord.stderr()[-3000:])
    assert coord.status()["bringup"]["state"] == "active", (
        coord.status()["bringup"], peers[0].stderr()[-3000:])
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    before = [running(daemons, p, READY_S) for p in peers]

    want = expected(model, PROMPT, 8)
    assert complete(port) == want
    # A conversation, each turn the whole of it again, as a chat UI sends it: mlx-lm's
    # answers, each turn but the first started from the prompt cache (every rank's).
    cached = growing_prompt(f"http://127.0.0.1:{port}/v1", "llama", model,
                            "Once upon a time", 3, 8)
    assert cached[0] == 0 and all(n > 5 for n in cached[1:]), cached

    # Each stage host's status shows its stage's group: a line and each rank's worker.
    for p in peers:
        shown = p.ctl("status")
        assert shown.returncode == 0, shown.stderr
        assert ("tensor group stage-tp: 2 ranks (stage = rank 0, stage-tp-1), all running"
                in shown.stdout), shown.stdout
        body: dict[str, Any] = json.loads(p.ctl("status", "--json").stdout)
        members = {w["name"]: w for w in body["workers"] if w.get("group") == "stage-tp"}
        assert set(members) == set(MEMBERS), body["workers"]
        assert members["stage-tp-1"]["role"] == "stage_tp"
        assert (members["stage"].get("stats") or {}).get("tensor") == {"rank": 0, "size": 2}
        layers = (members["stage"].get("stats") or {}).get("layers")
        assert layers in ([0, 2], [2, 4]), members["stage"]
        # its prompt cache: rank 0's hits, the follower holding as many entries, as many
        # bytes (its shard of each). Each worker's stats come every second, and the last
        # turn's release may change rank 0's entries after its hits were counted: both
        # are read again until they agree.
        agreed = wait_for(lambda d=p: caches_agree(d), 20,
                          "rank 0's prompt cache (2 hits) and stage-tp-1's to agree on "
                          "entries and bytes", every=0.2)
        assert agreed[0]["budget"] > 0 and agreed[0]["entries"] > 0, agreed

    # A follower killed: the supervisor restarts its group (stage and stage-tp-1 anew),
    # and the pipeline serves the same tokens again.
    victim = peers[0]
    os.kill(before[0]["stage-tp-1"], signal.SIGKILL)
    running(daemons, victim, BACK_S, before[0])
    restarts = [e for e in victim.events() if "its group restarts together" in
                (e.get("message") or "")]
    assert restarts, [e["message"] for e in victim.events()[-20:]]
    # the group restarted because of its follower, named, and by signal
    assert any(e["message"].startswith("group stage-tp: stage-tp-1 exited (killed by "
                                       "SIGKILL)") for e in restarts), restarts

    def served() -> str | None:
        try:
            return complete(port)
        except openai.APIError:
            return None

    assert wait_for(served, BACK_S, "a completion once the group is back", every=1.0) == want
    # the other stage host's group was not touched
    assert pids(peers[1]) == before[1]

    # A re-activate: a tensor stage is not kept serving as stage-retiring (not built for a
    # group): each host stops its group before the new plan's loads, and the new plan
    # serves the same tokens.
    again = coord.ctl("cluster", "activate", "--model", str(model), "--stages", "2",
                      timeout=UP_S)
    assert again.returncode == 0, (again.stdout, again.stderr)
    for p in peers:
        kinds = [e["kind"] for e in p.events()]
        assert "stage.replaced" in kinds and "stage.retiring" not in kinds, kinds
        running(daemons, p, READY_S)
    assert wait_for(served, BACK_S, "a completion from the new plan", every=1.0) == want
