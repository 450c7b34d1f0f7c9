"""A standby cut off from a coordinator that is alive and reaches its stage hosts does not
take over: the stage hosts' lease on their coordinator (cluster/lease.py) holds it back.
Real daemons on 127.0.0.x (``helpers/standby.py``: a coordinator .1, peers .2 .3 .4, one a
spare, the standby .5; every dead time 3 s, the lease as long); the standby's
``--pipeline-coordinator`` is a forwarder (``helpers/forwarder.py``, .6) in front of the
coordinator's agent, which the test makes silent (the partition) and mends.

1. Cut: the standby finds the coordinator unreachable, but past the dead time plus its
   bound (``standby.TAKEOVER_BOUND_S``) it has not taken over; `mlxctl status` says the
   stage peers still hear the coordinator (event ``standby.held``, once). The coordinator
   drains a stage host alone (`mlxctl drain`, re-planned onto the spare) under a load of
   streaming completions on its own router (retries off: none refused, none failed); the
   standby pushes nothing.
2. Mended, the standby follows the new plan. Then SIGSTOP of the coordinator's daemon (its
   router worker runs on): the stage hosts stop hearing it, their lease runs out, and the
   standby takes over within the dead time + ``TAKEOVER_BOUND_S`` (15 s here) of the stop,
   and drains the other stage host (its push taken: the lease ran out), under a load on
   its own router (none refused, none failed).
3. SIGCONT: the old coordinator, heard again, cannot push over the standby: its
   `mlxctl cluster activate` is refused by the stage hosts the standby's plan holds (code
   ``lease``, naming the standby), and every stage host keeps the standby's plan.

And once it took over (the coordinator's host killed), the standby heals a silent stage
host (its daemon and stage worker SIGSTOPped) onto the spare as a coordinator does
(``cluster/healer.py``, ``heal_after_s = 2`` here).

Every process is ended by pid (the ``daemons`` fixture; the stopped ones continued
first). The counts and times are printed (``pytest -s``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from mlxceld.daemon.standby import TAKEOVER_BOUND_S

from helpers.cluster import agent
from helpers.daemons import READY_S, Daemons
from helpers.forwarder import Forwarder
from helpers.load import StreamingLoad
from helpers.standby import DEAD_S, serves, standby_pipeline
from helpers.waiting import wait_for

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

BOUND_S = DEAD_S + TAKEOVER_BOUND_S  # from the coordinator's stop to the takeover
LOAD_BOUND_S = 120.0
REPLAN_WAIT_S = 60.0  # a drain's re-plan
HELD = "coordinator unreachable from here but heard by stage peers"


def active_after(d: Any, epoch: int) -> dict[str, Any] | None:
    b = d.status()["bringup"]
    return b if b and b.get("state") == "active" and b["epoch"] != epoch else None


def test_a_standby_cut_off_from_a_live_coordinator_waits_for_the_stage_hosts_lease(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    forwarders: list[Forwarder] = []

    def via(coordinator: str) -> str:
        host, _, port = coordinator.rpartition(":")
        forwarders.append(Forwarder("127.0.0.6", (host, int(port)), "127.0.0.5"))
        return forwarders[-1].address

    try:
        run(daemons, model, via, forwarders)
    finally:
        for f in forwarders:
            f.close()


def run(daemons: Daemons, model: Path, via: Any, forwarders: list[Forwarder]) -> None:
    p = standby_pipeline(daemons, model, via=via)
    fwd, coord, router, first = forwarders[0], p.coord, p.router, p.first
    coord_agent, standby_agent = agent(coord), agent(router)
    victim = first["peers"][1]["node_id"]  # the host of stage-1

    # 1. The partition: the coordinator alive, reaching its stage hosts, alone in acting.
    with StreamingLoad(f"{p.coord_url}/v1", clients=2, bound_s=LOAD_BOUND_S) as load:
        fwd.cut()
        cut_at = time.time()
        wait_for(lambda: HELD in (router.status()["standby"]["why"] or ""), BOUND_S + 5,
                 "the standby held back by the lease", every=0.2)
        time.sleep(max(0.0, cut_at + BOUND_S + 1 - time.time()))
        held = router.status()["standby"]
        said = router.ctl("status").stdout
        drained = coord.ctl("drain", victim, "--deadline", "120s", timeout=180)
        second = wait_for(lambda: active_after(coord, first["epoch"]), REPLAN_WAIT_S,
                          "the coordinator's re-plan active", every=0.2)
        time.sleep(1.0)
    counts = load.counts()
    print(f"\ncut off: the standby held back {held['why']!r}; the coordinator's drain of "
          f"{victim} under load on its router: {counts}")
    assert held["state"] == "standing by" and not held["took_over"], held
    assert HELD in said and "not taking over" in said, said
    assert load.refused == [] and load.failed == [], (load.refused[:3], load.failed[:3])
    assert drained.returncode == 0, (drained.stdout, drained.stderr)
    assert victim not in [n["node_id"] for n in second["peers"]], second
    assert router.status()["standby"]["state"] == "standing by"
    kinds = [e["kind"] for e in router.events(200)]
    assert kinds.count("standby.held") == 1, kinds
    assert not [k for k in kinds if k.startswith(("bringup.", "heal.", "drain.", "standby.took"))]
    hosts = {agent(h): h.status()["assignment"] for h in p.peers}
    assert [a for a in hosts.values() if a["epoch"] == second["epoch"]
            and a["coordinator"] == coord_agent], hosts

    # 2. Mended, the standby follows the new plan; then the coordinator's daemon stops.
    fwd.mend()
    wait_for(lambda: (f := router.status()["front"])["state"] == "following"
             and f["epoch"] == second["epoch"], 30, "the standby following the re-plan",
             every=0.2)
    wait_for(lambda: serves(p.url, model), 60, "the standby serving the re-plan", every=0.5)
    other = second["peers"][0]["node_id"]  # the host of stage-0, kept by the re-plan
    with StreamingLoad(f"{p.url}/v1", clients=2, bound_s=LOAD_BOUND_S) as load:
        time.sleep(1.0)
        os.kill(coord.pid, signal.SIGSTOP)
        stopped_at = time.time()
        try:
            took = wait_for(lambda: (s := router.status()["standby"])["took_over"] and s,
                            BOUND_S + 5, "the standby's takeover", every=0.2)
            drained = router.ctl("drain", other, "--deadline", "120s", timeout=180)
            third = wait_for(lambda: active_after(router, second["epoch"]), REPLAN_WAIT_S,
                             "the standby's re-plan active", every=0.2)
            time.sleep(1.0)
        finally:
            os.kill(coord.pid, signal.SIGCONT)
    counts = load.counts()
    print(f"the coordinator's daemon stopped: the standby took over "
          f"{took['since'] - stopped_at:.1f} s later (bound {BOUND_S:g} s) and drained "
          f"{other}, under load on its router: {counts}")
    assert took["since"] - stopped_at <= BOUND_S, (took, stopped_at)
    assert took["epoch"] == second["epoch"], took
    assert load.refused == [] and load.failed == [], (load.refused[:3], load.failed[:3])
    assert drained.returncode == 0, (drained.stdout, drained.stderr)
    assert third["epoch"] > second["epoch"] and other not in [
        n["node_id"] for n in third["peers"]], third

    # 3. The old coordinator, continued and heard again, cannot push over the standby.
    pushed = coord.ctl("cluster", "activate", "--model", str(model), "--stages", "2",
                       timeout=180)
    out = pushed.stdout + pushed.stderr
    print(f"the old coordinator's activate: exit {pushed.returncode}: {out[-300:]!r}")
    assert pushed.returncode != 0, out
    assert "lease" in out and standby_agent in out, out
    after = {agent(h): h.status()["assignment"] for h in p.peers}
    kept = [a for a in after.values() if a["epoch"] == third["epoch"]]
    assert len(kept) == 2 and all(a["coordinator"] == standby_agent and a["state"] == "active"
                                  for a in kept), after
    assert not [a for a in after.values() if a["epoch"] > third["epoch"]
                and a["state"] == "active"], after
    assert serves(p.url, model)


def test_a_standby_that_took_over_heals_a_silent_stage_host_onto_the_spare(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    p = standby_pipeline(daemons, model, standby_daemon="heal_after_s = 2\n")
    coord, router, first = p.coord, p.router, p.first
    by_node = {h.status()["daemon"]["node_id"]: h for h in p.peers}
    staged = [n["node_id"] for n in first["peers"]]
    for node in staged:
        daemons.pids.add(by_node[node].wait_worker("stage", timeout=READY_S,
                                                   state="running")["pid"])
    host_pids = [coord.pid, *(w["pid"] for w in coord.status()["workers"] if w["pid"])]
    daemons.pids.update(host_pids)
    for pid in host_pids:  # the coordinator's host goes
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: router.status()["standby"]["took_over"], BOUND_S + 5,
             "the standby's takeover", every=0.2)

    victim = by_node[staged[1]]
    pids = [victim.pid, victim.worker("stage")["pid"]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    try:
        healed = wait_for(lambda: active_after(router, first["epoch"]), 90,
                          "the standby's heal", every=0.2)
        healed_s = time.time() - stopped
        wait_for(lambda: serves(p.url, model), 60, "greedy text from the healed plan",
                 every=0.5)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    print(f"\na stage host SIGSTOPped after the takeover: the standby healed it "
          f"{healed_s:.1f} s later: plan {healed['epoch']} over "
          f"{[n['node_id'] for n in healed['peers']]}")
    nodes = [n["node_id"] for n in healed["peers"]]
    assert staged[1] not in nodes and staged[0] in nodes and len(nodes) == 2, (staged, nodes)
    kinds = [e["kind"] for e in router.events(300)]
    assert "standby.took_over" in kinds and [k for k in kinds if k.startswith("heal.")], kinds
