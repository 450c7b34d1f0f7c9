"""A standby coordinator over a 2D mesh, between real daemons on 127.0.0.x
(``helpers/standby.py``): a coordinator (.1) serving `--mesh tp` over two of three
`--pp-peer` hosts (.2 .. .4: one stage, a tensor group of 2, the third host a spare) and a
standby router (.5). The standby learns the plan with its tensor group (the
``plan`` answer's ``tp_group``); the coordinator's host killed (kill -9, by pid), it takes
over the mesh with every rank's host; the rank-1 host then put to sleep (SIGSTOP: daemon
and rank worker) past the grace, the standby heals the mesh over the hosts alive as the
coordinator would (``--mesh auto``) and serves mlx-lm's tokens from it. Without the
group the standby would watch the rank-0 host alone and never heal. Every process is
ended by pid."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from mlxceld.daemon.standby import TAKEOVER_BOUND_S

from helpers.cluster import agent
from helpers.daemons import READY_S, Daemons
from helpers.front import host_pids, kill_host
from helpers.standby import DEAD_S, serves, standby_pipeline
from helpers.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HEAL_WAIT_S = 90.0  # the grace, a poll (10 s at most), the push and the new group's load


def test_a_standby_takes_over_a_mesh_with_its_groups_and_heals_it_as_a_mesh(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    p = standby_pipeline(daemons, model, mesh="tp", standby_daemon="heal_after_s = 2\n")
    router, first = p.router, p.first
    ranks = {r["stage"]: r["address"] for r in first["peers"]}
    assert set(ranks) == {"stage-0", "stage-0-tp-1"}, first
    standby = router.status()["standby"]
    assert standby["tp_size"] == 2, standby  # the answer carried the stage's group
    by_agent = {agent(d): d for d in p.peers}
    one = by_agent[ranks["stage-0-tp-1"]]
    rank_pid = one.wait_worker("stage-tp-1", timeout=READY_S, state="running")["pid"]
    daemons.pids.add(rank_pid)

    kill_host(p.coord, host_pids(daemons, p.coord))
    took = wait_for(lambda: (s := router.status()["standby"])["took_over"] and s,
                    DEAD_S + TAKEOVER_BOUND_S + 5, "the standby's takeover", every=0.2)
    assert took["epoch"] == first["epoch"] and "x tp 2" in took["summary"], took
    asleep = [one.pid, rank_pid]
    for pid in asleep:
        os.kill(pid, signal.SIGSTOP)
    try:
        healed = wait_for(lambda: (b := router.status()["bringup"]) and b.get("state")
                          == "active" and b["epoch"] > first["epoch"] and b, HEAL_WAIT_S,
                          "the standby's heal of the mesh", every=0.2)
        assert ranks["stage-0-tp-1"] not in {r["address"] for r in healed["peers"]}, healed
        planned = [e for e in router.events(200) if e["kind"] == "heal.planned"]
        assert planned and ranks["stage-0-tp-1"] not in planned[-1]["data"]["peers"], planned
        assert wait_for(lambda: serves(p.url, model), READY_S, "mlx-lm's tokens from the "
                        "healed plan", every=1.0)
    except BaseException:
        print(router.stderr()[-3000:], [(e["kind"], e["message"])
                                        for e in router.events(200)[-15:]], sep="\n")
        raise
    finally:
        for pid in asleep:
            os.kill(pid, signal.SIGCONT)
        for d in (router, *p.peers):
            daemons.note(d)
