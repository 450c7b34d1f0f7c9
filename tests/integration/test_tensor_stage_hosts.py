"""A 2 x 2 mesh across four hosts on real daemons (issue 32): `--pp-auto 2` on a
coordinator (127.0.0.1) and two `--pp-peer --tp-size 2 --tp-peers` stage hosts (127.0.0.2,
.3), each naming its own rank host (127.0.0.4, .5, `--node-role tensor_parallel_rank`):
five daemons, four ranks. Each stage host forms its stage's group with its rank host
(``daemon/stage_peers.py``): its ``stage`` worker is rank 0 and the rank host's
``stage-tp-1`` rank 1, over the stage's layers. Greedy completions through the `openai`
client are mlx-lm's on the whole model; status on a stage host shows its group across
hosts; a rank killed with SIGKILL, or stopped with SIGTERM, breaks its stage's ring
(rank 0 names it gone), the stage restarts and its rank host is asked again, and the
pipeline serves the same tokens again, as it does after a rank host's daemon is
restarted (the stage host asks it until it is back, and restarts its stage over the
rank host's new ring port: ``tensor.ring_moved``) and after a re-activate (each group
stopped before the new plan's loads, then formed again)."""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import openai
import pytest

from helpers.cluster import agent, start
from helpers.daemons import READY_S, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.mesh import complete
from helpers.mesh import running_worker as worker
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.waiting import wait_for

# Bring-up of five model processes and a router on a loaded 2-core machine, and a ring's
# restart across hosts. Bounds on waiting, not what is asserted about time.
UP_S = 240.0
BACK_S = 180.0
# A rank host's daemon restarted: its stage back over the new ring, well within the ring's
# 60 s deadline (a liveness bound; it takes about 10 s here).
MOVED_S = 40.0


def gone(stage: DaemonProc, host: str) -> int:
    """How often the stage worker on ``stage`` ended because it saw its rank 1 on
    ``host`` gone, as its log says (``engine/tensor.py``'s watchdog)."""
    logged = stage.ctl("logs", "stage", "-n", "2000").stdout
    return logged.count(f"tensor-parallel rank 1 (worker stage-tp-1 on {host}) is gone: "
                        "its op link closed; this rank exits")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pipeline_of_two_stages_each_a_group_across_hosts_serves_mlx_lms_tokens(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    # Each rank host's agent at a port of its own, as a service is configured: the one
    # restarted below comes back where its stage host's --tp-peers names it.
    rank_args = [("--cluster-secret-file", "", "--agent-addr",
                  f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}", "--node-role",
                  "tensor_parallel_rank", "--model", str(model)) for i in (4, 5)]
    ranks = []
    for i, args in zip((4, 5), rank_args, strict=True):
        r = daemons.make(name=f"r{i}")
        ranks.append(r.start(args[0], str(secret_file(r.root, secret)), *args[2:]))
    stages = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--tp-size", "2",
                    "--tp-peers", agent(r), "--model", str(model), name=f"p{i}")
              for i, r in zip((2, 3), ranks, strict=True)]
    # No placement yet: no stage worker, no rank asked.
    assert all(worker(p, "stage") is None for p in stages)
    port = free_port("127.0.0.1")
    coord = daemons.make(name="c")
    coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                "--agent-addr", f"127.0.0.1:{free_port('127.0.0.1')}",
                "--cluster-peers", ",".join(agent(p) for p in stages), "--pp-auto", "2",
                "--model", str(model), "--port", str(port))
    wait_for(lambda: (coord.status().get("bringup") or {}).get("state") in ("active", "failed"),
             UP_S, "the push to end\n" + coord.stderr()[-3000:])
    assert coord.status()["bringup"]["state"] == "active", (
        coord.status()["bringup"], stages[0].stderr()[-3000:], ranks[0].stderr()[-3000:])
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    for p, r in zip(stages, ranks, strict=True):
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
        daemons.pids.add(r.wait_worker("stage-tp-1", timeout=READY_S, state="running")["pid"])

    want = expected(model, PROMPT, 8)
    assert complete(port) == want

    seen: list[list[int]] = []
    for p, r in zip(stages, ranks, strict=True):
        names = {w["name"] for w in p.status()["workers"]}
        assert "stage-tp-1" not in names, names  # rank 1 is the rank host's, not here
        tensor = p.status()["tensor"]
        assert tensor["role"] == "rank0" and tensor["state"] == "formed", tensor
        assert tensor["size"] == 2 and tensor["ranks"][0]["worker"] == "stage", tensor
        assert tensor["ranks"][0]["ring"].startswith(p.status()["agent"]["address"]
                                                     .rsplit(":", 1)[0] + ":"), tensor
        assert tensor["ranks"][1]["agent"] == agent(r), tensor
        assert tensor["ranks"][1]["state"] == "joined", tensor
        layers = tensor["stage"]["layers"]
        seen.append(layers)
        stats = worker(p, "stage") or {}
        assert (stats.get("stats") or {}).get("tensor") == {"rank": 0, "size": 2}, stats
        # the rank host runs the stage's rank 1 over the same layers, in the same ring
        shown = r.status()["tensor"]
        assert shown["worker"] == "stage-tp-1" and shown["rank"] == 1, shown
        assert shown["stage"]["layers"] == layers, shown
        assert shown["ring"] == tensor["ranks"][1]["ring"], (shown, tensor)
        assert (worker(r, "stage-tp-1") or {}).get("role") == "stage_tp"
        # and mlxctl status says so, on both
        node, (lo, hi) = tensor["stage"]["node_id"], layers
        on_stage, on_rank = p.ctl("status"), r.ctl("status")
        assert (f"tensor group of 2 ranks across hosts of stage {node} (layers [{lo}, "
                f"{hi})): formed") in on_stage.stdout, on_stage.stdout
        assert (f"tensor rank 1 of 2 of stage {node} (layers [{lo}, {hi})): ring "
                f"{shown['ring']}") in on_rank.stdout, on_rank.stdout
        assert "worker stage-tp-1 running" in on_rank.stdout, on_rank.stdout
    assert sorted(seen) == [[0, 2], [2, 4]], seen

    # A rank killed: its stage's ring breaks, the stage restarts, its rank host is asked
    # again, and the pipeline serves the same tokens again.
    victim = (worker(ranks[0], "stage-tp-1") or {})["pid"]
    before = (worker(stages[0], "stage") or {})["pid"]
    os.kill(victim, signal.SIGKILL)

    def served() -> str | None:
        try:
            return complete(port)
        except openai.APIError:
            return None

    def back(i: int, before: int, why: str, bound: float = BACK_S) -> float:
        """Stage ``i``'s worker restarted (another pid than ``before``) within ``bound``,
        then the pipeline serving mlx-lm's tokens: the seconds the restart took; on a
        failure, what its daemons said."""
        began = time.monotonic()
        try:
            wait_for(lambda: (w := worker(stages[i], "stage")) and w["pid"] != before,
                     bound, f"the stage restarted after {why}")
            took = time.monotonic() - began
            assert wait_for(served, BACK_S, f"a completion after {why}", every=1.0) == want
        except BaseException:
            print(stages[i].stderr()[-6000:], ranks[i].stderr()[-4000:],
                  coord.stderr()[-3000:], [(e["kind"], e["message"])
                                           for e in stages[i].events()[-15:]],
                  sep="\n----\n")
            raise
        return took

    back(0, before, "its ring broke")
    kinds = [e["kind"] for e in stages[0].events()]
    assert "tensor.rejoin" in kinds, kinds

    # The rank's worker alone stopped with SIGTERM (it exits cleanly, and its rank host
    # keeps it down): rank 0 sees its op link close, names it, and exits; the restarted
    # stage asks the rank host again, which starts the rank anew at the same port.
    victim = (worker(ranks[0], "stage-tp-1") or {})["pid"]
    before = (worker(stages[0], "stage") or {})["pid"]
    said = gone(stages[0], "127.0.0.4")
    os.kill(victim, signal.SIGTERM)
    back(0, before, "its rank was stopped")
    assert gone(stages[0], "127.0.0.4") == said + 1, stages[0].ctl("logs", "stage").stdout
    daemons.pids.add((worker(ranks[0], "stage-tp-1") or {})["pid"])

    # A rank host's daemon restarted as a service manager does (SIGTERM, then started
    # again with the same flags): its rank ends with it, rank 0 sees its op link close
    # and exits, and the stage host asks the rank host again until it is back. Its ring
    # port is a new one: the stage worker restarted over the old ring is stopped before
    # the rank joins the new one (tensor.ring_moved), so neither waits out its ring's
    # deadline (60 s) in a ring that cannot form; then the pipeline serves as before.
    before = (worker(stages[1], "stage") or {})["pid"]
    since = stages[1].events()[-1]["id"]
    assert ranks[1].terminate() == 0
    ranks[1].start(rank_args[1][0], str(secret_file(ranks[1].root, secret)),
                   *rank_args[1][2:])
    took = back(1, before, "its rank host's daemon restarted (a new ring)", MOVED_S)
    print(f"\nrank host's daemon restarted: its stage restarted {took:.1f} s after it")
    assert gone(stages[1], "127.0.0.5") == 1, stages[1].ctl("logs", "stage").stdout
    after = [e for e in stages[1].events() if e["id"] > since]
    assert "tensor.ring_moved" in [e["kind"] for e in after], after
    failed = [e["message"] for e in after if e["kind"] == "worker.backoff"
              and "ring" in e["message"]]
    assert not failed, failed  # no stage start failed in a ring that could not form
    assert (ranks[1].status()["tensor"] or {}).get("worker") == "stage-tp-1"
    daemons.pids.add((worker(ranks[1], "stage-tp-1") or {})["pid"])

    # A re-activate: each stage host's group is stopped before the new plan's loads, its
    # rank host asked again, and the new plan serves the same tokens.
    again = coord.ctl("cluster", "activate", "--model", str(model), "--stages", "2",
                      timeout=UP_S)
    assert again.returncode == 0, (again.stdout, again.stderr, stages[0].stderr()[-3000:])
    for p in stages:
        kinds = [e["kind"] for e in p.events()]
        assert "stage.replaced" in kinds and "stage.retiring" not in kinds, kinds
    assert wait_for(served, BACK_S, "a completion from the new plan", every=1.0) == want
    for d in (*stages, *ranks):
        for name in ("stage", "stage-tp-1"):
            w = worker(d, name)
            if w is not None:
                daemons.pids.add(w["pid"])
