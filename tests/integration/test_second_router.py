"""A second router in front of a pipeline, between real daemons on 127.0.0.x: a coordinator
(.1) serving a 2-stage plan over two peers (.2, .3), and a router (.5, ``--node-role router
--pipeline-coordinator``) that asks the coordinator for the plan and drives the same stages.

The coordinator's host holds no stage (its daemon runs the router only). Under a bounded
load of streaming completions through the real `openai` client with retries off, on
both routers, kill -9 the coordinator's host (its daemon and every worker, by pid): the
second router's requests keep succeeding (none refused, none failed), the stage hosts
keep their stages, the router's status says the coordinator is unreachable; the load on
the coordinator's own port is counted (it fails: the single front this removes). The
counts are printed (``pytest -s``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from helpers.cluster import activate, agent, coordinator, start
from helpers.daemons import READY_S, DaemonProc, Daemons, alive
from helpers.keys import secret_file
from helpers.load import StreamingLoad
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import greedy
from helpers.waiting import wait_for

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

WARM_S = 3.0  # load on both routers before the kill
AFTER_S = 8.0  # load on the second router after it
FOLLOW_WAIT_S = 120.0  # the router learns the plan (1 s polls) and loads its tokenizer
LOAD_BOUND_S = 90.0


def second_router(daemons: Daemons, secret: bytes, coord: DaemonProc, model: Path
                  ) -> tuple[DaemonProc, int, tuple[str, ...]]:
    """The router on 127.0.0.5 in front of ``coord``'s pipeline; its OpenAI port, and its
    flags (a restart starts it with them)."""
    port = free_port("127.0.0.5")
    router = daemons.make(name="r")
    flags = ("--cluster-secret-file", str(secret_file(router.root, secret)),
             "--agent-addr", f"127.0.0.5:{free_port('127.0.0.5')}", "--node-role", "router",
             "--pipeline-coordinator", agent(coord), "--model", str(model),
             "--host", "127.0.0.5", "--port", str(port))
    router.start(*flags)
    return router, port, flags


def serves(url: str, model: Path) -> bool:
    try:
        return greedy(url, PROMPT, 8, model="llama") == expected(model, PROMPT, 8)
    except Exception:  # the router loading, or not yet attached: not yet
        return False


def test_the_second_router_serves_on_when_the_coordinators_host_is_killed(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = os.urandom(16).hex().encode()
    peers = [start(daemons, ip, secret, "--pp-peer", "--model", str(model), name=f"p{ip[-1]}")
             for ip in ("127.0.0.2", "127.0.0.3")]
    coord, coord_port, coord_flags = coordinator(daemons, secret, peers)
    activate(coord, model, 2)
    router, port, router_flags = second_router(daemons, secret, coord, model)
    url = f"http://127.0.0.5:{port}"
    wait_for(lambda: serves(url, model), FOLLOW_WAIT_S, "the second router serving",
             every=0.5)
    front = router.status()["front"]
    assert front["state"] == "following" and front["coordinator"] == agent(coord), front
    assert front["epoch"] == coord.status()["bringup"]["epoch"]
    said = router.ctl("status").stdout
    assert f"front: following coordinator {agent(coord)}: plan {front['epoch']}" in said, said
    assert len(front["stages"]) == 2
    stage_pids = [p.wait_worker("stage", timeout=READY_S, state="running")["pid"]
                  for p in peers]
    daemons.pids.update(stage_pids)
    host_pids = [coord.pid, *(w["pid"] for w in coord.status()["workers"] if w["pid"])]
    daemons.pids.update(host_pids)

    with StreamingLoad(f"{url}/v1", clients=4, bound_s=LOAD_BOUND_S) as load, \
            StreamingLoad(f"http://127.0.0.1:{coord_port}/v1", clients=2,
                          bound_s=LOAD_BOUND_S) as before:
        time.sleep(WARM_S)
        at_kill = load.counts()
        for pid in host_pids:  # the coordinator's host goes: its daemon and its workers
            os.kill(pid, signal.SIGKILL)
        assert coord.proc is not None and coord.proc.wait(10) == -signal.SIGKILL
        time.sleep(AFTER_S)
    counts, lost = load.counts(), before.counts()
    print(f"\nkill -9 of the coordinator's host under load: second router {counts} "
          f"({at_kill['completed']} completed before the kill); the coordinator's own "
          f"port {lost}")
    assert load.refused == [] and load.failed == [], (load.refused[:3], load.failed[:3])
    assert counts["completed"] > at_kill["completed"] + 2, (at_kill, counts)
    assert all(not alive(pid) for pid in host_pids)
    assert lost["refused"] + lost["failed"] > 0, lost  # the single front it replaces
    # The stage hosts keep their stages; the router says its coordinator is gone.
    assert [p.worker("stage")["pid"] for p in peers] == stage_pids
    front = wait_for(lambda: (f := router.status()["front"])["state"] == "unreachable"
                     and f, 15, "the router to see its coordinator gone", every=0.2)
    assert front["epoch"] is not None and len(front["stages"]) == 2, front
    assert serves(url, model)
    said = router.ctl("status").stdout
    assert f"front: coordinator {front['coordinator']} unreachable since" in said, said

    # The router's daemon killed and restarted while the coordinator is down: it serves
    # the plan it kept, its worker re-adopted; the coordinator back, it follows it again.
    worker = router.worker("router")["pid"]
    daemons.pids.add(worker)
    with StreamingLoad(f"{url}/v1", clients=2, bound_s=LOAD_BOUND_S) as again:
        assert router.proc is not None
        router.proc.kill()
        router.proc.wait(10)
        router.start(*router_flags)
        assert router.status()["front"]["state"] == "unreachable"
        assert router.worker("router")["pid"] == worker  # re-adopted, not restarted
        coord.start(*coord_flags)
        wait_for(lambda: router.status()["front"]["state"] == "following", FOLLOW_WAIT_S,
                 "the router following the restarted coordinator", every=0.5)
        time.sleep(WARM_S)
    print(f"the router's daemon restarted, then the coordinator: {again.counts()}")
    assert again.refused == [] and again.failed == [], (again.refused[:3], again.failed[:3])
    assert again.counts()["completed"] > 0


def test_the_second_router_follows_a_drains_replan_live(daemons: Daemons,
                                                        split_fixture_dir: Path) -> None:
    """A drain of a stage node re-plans onto the spare: the second router learns the new
    plan within a few seconds and moves to it live, its load neither refused nor failed;
    the old plan's stages stop only once it asked for the new plan (``Fronts``)."""
    model = split_fixture_dir / "llama"
    secret = os.urandom(16).hex().encode()
    peers = [start(daemons, ip, secret, "--pp-peer", "--model", str(model), name=f"p{ip[-1]}")
             for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
    coord, _, _ = coordinator(daemons, secret, peers)
    activate(coord, model, 2)
    first = coord.status()["bringup"]
    router, port, _ = second_router(daemons, secret, coord, model)
    url = f"http://127.0.0.5:{port}"
    wait_for(lambda: serves(url, model), FOLLOW_WAIT_S, "the second router serving",
             every=0.5)
    router_pid = router.worker("router")["pid"]
    daemons.pids.add(router_pid)
    victim = first["peers"][1]["node_id"]  # the host of stage-1
    with StreamingLoad(f"{url}/v1", clients=4, bound_s=LOAD_BOUND_S) as load:
        time.sleep(WARM_S)
        drained = coord.ctl("drain", victim, "--deadline", "120s", timeout=180)
        assert drained.returncode == 0, (drained.stdout, drained.stderr)
        try:
            front = wait_for(lambda: (f := router.status()["front"])["epoch"]
                             != first["epoch"] and f, 30, "the second router on the new plan",
                             every=0.2)
        except BaseException:
            print(drained.stdout, router.status()["front"], coord.status()["bringup"],
                  [(e["kind"], e["message"]) for e in coord.events(60)],
                  [(e["kind"], e["message"]) for e in router.events(30)])
            raise
        time.sleep(WARM_S)
    counts = load.counts()
    print(f"\ndrain of {victim} under load on the second router: {counts}; it follows "
          f"plan {front['epoch']} ({front['stages']})")
    assert load.refused == [] and load.failed == [], (load.refused[:3], load.failed[:3])
    assert counts["completed"] > 0
    new = coord.status()["bringup"]
    assert front["epoch"] == new["epoch"] and front["state"] == "following", (front, new)
    assert victim not in [p["node_id"] for p in new["peers"]], new
    assert router.worker("router")["pid"] == router_pid  # moved live, not restarted
    kinds = [e["kind"] for e in router.events(100)]
    assert kinds.count("front.followed") == 2, kinds
    # Make before break's end waited for this router to ask for the new plan too.
    retired = wait_for(lambda: [e for e in coord.events(100) if e["kind"] == "drain.retired"],
                       60, "the old plan retired", every=0.2)
    assert retired[0]["data"]["closed"], retired
