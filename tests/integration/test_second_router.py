"""A second router in front of a pipeline, between real daemons on 127.0.0.x: a coordinator
(.1) serving a 2-stage plan over two peers (.2, .3), and a router (.5, ``--node-role router
--pipeline-coordinator``) that asks the coordinator for the plan and drives the same stages.

The coordinator's host holds no stage (its daemon runs the router only). Under a bounded
load of streaming completions through the real `openai` client with retries off, on
both routers, kill -9 the coordinator's host (its daemon and every worker, by pid): the
second router's requests keep succeeding (none refused, none failed), the stage hosts
keep their stages, the router's status says the coordinator is unreachable; the load on
the coordinator's own port is counted (it fails: the single front this removes). The
counts are printed (``pytest -s``).

The router of the drain's test names its coordinator as users of a config file and host
names do: ``[serve] pipeline_coordinator = "localhost:PORT"``, no flag."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers.cluster import agent
from helpers.daemons import READY_S, Daemons, alive
from helpers.front import (
    FOLLOW_WAIT_S,
    front_router,
    host_pids,
    kill_host,
    pipeline,
    serves,
)
from helpers.load import StreamingLoad
from helpers.waiting import wait_for

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

WARM_S = 3.0  # load on both routers before the kill
AFTER_S = 8.0  # load on the second router after it
LOAD_BOUND_S = 90.0


def test_the_second_router_serves_on_when_the_coordinators_host_is_killed(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    pipe = pipeline(daemons, split_fixture_dir, 2)
    model, peers, coord = pipe.model, pipe.peers, pipe.coord
    r = front_router(daemons, pipe)
    router, url = r.router, r.url
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
    pids = host_pids(daemons, coord)

    with StreamingLoad(f"{url}/v1", clients=4, bound_s=LOAD_BOUND_S) as load, \
            StreamingLoad(f"http://127.0.0.1:{pipe.coord_port}/v1", clients=2,
                          bound_s=LOAD_BOUND_S) as before:
        time.sleep(WARM_S)
        at_kill = load.counts()
        kill_host(coord, pids)  # the coordinator's host goes: its daemon and its workers
        time.sleep(AFTER_S)
    counts, lost = load.counts(), before.counts()
    print(f"\nkill -9 of the coordinator's host under load: second router {counts} "
          f"({at_kill['completed']} completed before the kill); the coordinator's own "
          f"port {lost}")
    assert load.refused == [] and load.failed == [], (load.refused[:3], load.failed[:3])
    assert counts["completed"] > at_kill["completed"] + 2, (at_kill, counts)
    assert all(not alive(pid) for pid in pids)
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
        router.start(*r.flags)
        assert router.status()["front"]["state"] == "unreachable"
        # re-adopted, not restarted: its pid once the daemon confirmed it (its channel
        # asked, bounded; a loaded host takes a moment, the pid unset meanwhile)
        adopted = wait_for(lambda: router.worker("router")["pid"], 15,
                           "the router's worker re-adopted or started", every=0.1)
        assert adopted == worker, router.worker("router")
        coord.start(*pipe.coord_flags)
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
    pipe = pipeline(daemons, split_fixture_dir, 3)
    model, coord, first = pipe.model, pipe.coord, pipe.first
    # The coordinator by host name, in the config file (config/front.py): as users write it.
    r = front_router(daemons, pipe, by_name="localhost")
    router, url = r.router, r.url
    wait_for(lambda: serves(url, model), FOLLOW_WAIT_S, "the second router serving",
             every=0.5)
    named = f"localhost:{agent(coord).rsplit(':', 1)[1]}"
    assert router.status()["front"]["coordinator"] == named, router.status()["front"]
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
