"""A coordinator's `mlxctl status` problems from the failure detector: each peer of its
active plan that is suspect or dead, since when, why and what to do; nothing for other
peers, other plans, or a daemon that does not coordinate. Real SQLite; the daemon's side
is a record of fakes (``MemberParts``)."""

from __future__ import annotations

import time
from pathlib import Path

import sqlite_utils

from mlxceld.cluster.member import ClusterMember, MemberParts
from mlxceld.config.daemon import Overrides, build_config
from mlxceld.discovery.candidates import CandidateTable
from mlxceld.state import EventLog, LivenessRow, LivenessTable, RotationsTable, Settings
from mlxceld.state.plans import Assignments, Plans
from mlxceld.wire import Keyring

B, C, D = "127.0.0.2:19000", "127.0.0.3:19000", "127.0.0.4:19000"


def member(db: sqlite_utils.Database, tmp_path: Path, **daemon: object) -> ClusterMember:
    config = build_config({"daemon": {"state_dir": str(tmp_path / "s"), **daemon}},
                          tmp_path / "mlxceld.toml", Overrides())
    parts = MemberParts(lambda: config, lambda: False, lambda: None, lambda: False, frozenset,
                        None, None, None)  # type: ignore[arg-type]
    return ClusterMember(parts, None, EventLog(db), Keyring(),  # type: ignore[arg-type]
                         node_id="me", candidates=CandidateTable(), plans=Plans(db),
                         assignments=Assignments(db), liveness=LivenessTable(db),
                         rotations=RotationsTable(db), settings=Settings(db))


def test_a_plans_suspect_or_dead_peer_is_a_problem(db: sqlite_utils.Database,
                                                   tmp_path: Path) -> None:
    plans, rows = Plans(db), LivenessTable(db)
    since = time.time() - 42
    rows.put(LivenessRow(B, "dead", since, "no answer to pings for 10 s", since,
                         node_id="mac-b", last_answer=since - 10))
    rows.put(LivenessRow(C, "alive", since, "answered a ping", since))
    rows.put(LivenessRow(D, "suspect", since, "no answer to pings for 3 s", since))
    m = member(db, tmp_path)
    assert m.problems() == []  # no plan yet: D is no plan's peer
    plans.create(7, "lab", "id", (B, C), "toml")
    assert m.problems() == []  # undecided
    plans.decide(7, "active")
    [problem] = m.problems()  # C is alive; D is not in the plan
    assert problem["subject"] == "mac-b" and problem["since"] == since
    clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    assert problem["message"].startswith(
        f"node mac-b ({B}) of the active plan is dead since {clock}: no answer to pings "
        "for 10 s; its last answer was at ")
    assert B in problem["next"] and "mlxctl cluster nodes" in problem["next"]
    nodes = m.nodes().to_json()  # the detector's rows also where it does not run (no secret here)
    assert nodes["detector"]["running"] is False and nodes["detector"]["dead_after_s"] == 10
    assert [r["address"] for r in nodes["liveness"]] == [B, C, D]
    plans.decide(7, "deactivated")
    assert m.problems() == []
    plans.create(8, "lab", "id", (D,), "toml")
    plans.decide(8, "activate")
    assert [p["subject"] for p in m.problems()] == [D]  # no node id known: the address
    assert m.problems()[0]["message"].startswith(f"peer {D} of the active plan is suspect")
    assert member(db, tmp_path, pp_peer=True).problems() == []  # a peer coordinates nothing
