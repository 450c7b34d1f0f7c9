"""A standby coordinator, between real daemons on 127.0.0.x: a coordinator (.1, no stage of
its own) serving a 2-stage plan over two of three peers (.2, .3, .4: one spare), and a
router (.5, ``--node-role router --pipeline-coordinator .1 --standby``, the peers in its
``--cluster-peers``) that follows the plan; every daemon's dead time 3 s
(``helpers/standby.py``: the stage hosts' lease on their coordinator as long).

Under a bounded load of streaming completions on the standby (the real `openai` client,
retries off): kill -9 of the coordinator's host (its daemon and every worker, by pid);
the standby's requests keep succeeding (none refused, none failed) and it takes over
within its stated bound (the dead time + ``standby.TAKEOVER_BOUND_S``); then `mlxctl
drain` of a stage host on the standby re-plans onto the spare (none refused, none
failed); then the old coordinator restarted on its state dir stands down: the peers'
newest plan is still the standby's (``--pp-peer`` hosts' ``assignment``), and the old
coordinator's status names the standby. The counts are printed (``pytest -s``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from mlxceld.daemon.standby import TAKEOVER_BOUND_S

from helpers.cluster import agent
from helpers.daemons import Daemons, alive
from helpers.load import StreamingLoad
from helpers.standby import DEAD_S, serves, standby_pipeline
from helpers.waiting import wait_for

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

WARM_S = 3.0
LOAD_BOUND_S = 120.0
REPLAN_WAIT_S = 60.0  # a drain's re-plan: a poll (10 s at most) and a push


def test_a_standby_takes_over_healing_and_drains_and_the_old_coordinator_stands_down(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    p = standby_pipeline(daemons, model)
    peers, coord, coord_flags, first, router, url = (p.peers, p.coord, p.coord_flags,
                                                     p.first, p.router, p.url)
    coord_agent = agent(coord)
    standby = router.status()["standby"]
    assert standby["state"] == "standing by" and standby["coordinator"] == coord_agent
    assert f"standby: standing by for coordinator {coord_agent}" in router.ctl("status").stdout
    host_pids = [coord.pid, *(w["pid"] for w in coord.status()["workers"] if w["pid"])]
    daemons.pids.update(host_pids)
    victim = first["peers"][1]["node_id"]  # the host of stage-1

    with StreamingLoad(f"{url}/v1", clients=4, bound_s=LOAD_BOUND_S) as load:
        time.sleep(WARM_S)
        killed_at = time.time()
        for pid in host_pids:  # the coordinator's host goes: its daemon and its workers
            os.kill(pid, signal.SIGKILL)
        assert coord.proc is not None and coord.proc.wait(10) == -signal.SIGKILL
        bound = DEAD_S + TAKEOVER_BOUND_S
        try:
            took = wait_for(lambda: (s := router.status()["standby"])["took_over"] and s,
                            bound + 5, "the standby's takeover", every=0.2)
        except BaseException:
            print(router.status()["standby"], router.status()["front"],
                  router.api(lambda c: c.cluster_nodes())["nodes"])
            raise
        at_takeover = load.counts()
        drained = router.ctl("drain", victim, "--deadline", "120s", timeout=180)
        new = wait_for(lambda: (b := router.status()["bringup"]) and b.get("state") == "active"
                       and b["epoch"] != first["epoch"] and b, REPLAN_WAIT_S,
                       "the standby's re-plan active", every=0.2)
        time.sleep(WARM_S)
    counts = load.counts()
    print(f"\nkill -9 of the coordinator's host, then a drain of {victim} on the standby, "
          f"under load: {counts} ({at_takeover} at the takeover, "
          f"{took['since'] - killed_at:.1f} s after the kill; bound {bound:g} s)")
    assert load.refused == [] and load.failed == [], (load.refused[:3], load.failed[:3])
    assert all(not alive(pid) for pid in host_pids)
    assert took["since"] - killed_at <= bound, (took, killed_at)
    assert took["epoch"] == first["epoch"], took
    said = router.ctl("status").stdout
    assert f"from coordinator {coord_agent} (plan {first['epoch']})" in said, said
    assert drained.returncode == 0, (drained.stdout, drained.stderr)
    assert new["epoch"] > first["epoch"], new
    assert victim not in [p["node_id"] for p in new["peers"]], new
    assert counts["completed"] > at_takeover["completed"], (at_takeover, counts)
    assert serves(url, model)
    # Make before break's end: the host the new plan kept hears from the standby that the
    # old plan is over (its stage of it stops), though that plan came from the coordinator.
    retired = wait_for(lambda: [e for e in router.events(100) if e["kind"] == "drain.retired"],
                       30, "the old plan retired", every=0.2)
    assert "refused" not in retired[0]["message"], retired

    # The old coordinator restarted on its state dir: it learns from the peers that the
    # standby's plan superseded its own and stands down (no router, no push).
    spare = {p["node_id"] for p in new["peers"]} - {p["node_id"] for p in first["peers"]}
    assert len(spare) == 1, (first, new)
    held = {agent(p): p.status()["assignment"] for p in peers}
    coord.start(*coord_flags)
    down = wait_for(lambda: coord.status()["stood_down"], 20, "the old coordinator to stand "
                    "down", every=0.2)
    assert down["epoch"] == first["epoch"] and down["superseded_by"] == new["epoch"], down
    assert down["coordinator"] == agent(router), down
    said = coord.ctl("status").stdout
    assert f"coordinator: stood down: plan {first['epoch']} was superseded by plan " \
        f"{new['epoch']} of coordinator {agent(router)}" in said, said
    # The drained host's stage of the old plan, which the standby could not stop (the
    # plan came from the old coordinator), stops now; no plan is pushed.
    drained_host = next(p for p in peers if p.status()["daemon"]["node_id"] == victim)
    gone = wait_for(lambda: (a := drained_host.status()["assignment"])["state"]
                    == "deactivated" and a, 15, "the drained host told its plan is over",
                    every=0.2)
    assert gone["epoch"] == first["epoch"], gone
    time.sleep(WARM_S)  # a resume would have pushed or started its router by now
    after = {agent(p): p.status()["assignment"] for p in peers}
    assert {a: r["epoch"] for a, r in after.items()} == \
        {a: r["epoch"] for a, r in held.items()}, (held, after)
    assert all(r["epoch"] <= new["epoch"] for r in after.values()), after
    assert "router" not in [w["name"] for w in coord.status()["workers"]]
    events = coord.events(100)
    since = max(i for i, e in enumerate(events) if e["kind"] == "daemon.started")
    after = [e["kind"] for e in events[since:]]
    assert "coordinator.stood_down" in after, after
    assert not [k for k in after if k.startswith(("bringup.", "heal.", "drain."))], after
    assert serves(url, model)
