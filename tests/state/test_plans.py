"""The two-phase assignment's tables: plans (coordinator) and assignments (peer)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import sqlite_utils

from mlxceld.state import open_db
from mlxceld.state.plans import Assignments, Plans


def test_plans_survive_a_reopen_with_their_decision(tmp_path: Path) -> None:
    db = open_db(tmp_path / "state.db")
    plans = Plans(db)
    epoch = plans.next_epoch(now=1000.0)
    assert epoch == 1_000_000
    plans.create(epoch, "c", "ab" * 32, ("stage-0", "stage-1"), "[cluster]\n")
    assert plans.get(epoch) is not None and plans.get(epoch).decision is None  # type: ignore[union-attr]
    plans.decide(epoch, "commit")
    with pytest.raises(ValueError, match="unknown plan decision"):
        plans.decide(epoch, "maybe")
    db.conn.close()
    again = Plans(open_db(tmp_path / "state.db"))
    row = again.latest()
    assert row is not None and row.decision == "commit" and row.peers == ("stage-0", "stage-1")
    assert again.next_epoch(now=0.0) == epoch + 1  # never goes back, whatever the clock says


def test_assignments_keep_the_newest_epoch_and_state(tmp_path: Path) -> None:
    a = Assignments(open_db(tmp_path / "state.db"))
    assert a.newest_epoch() == 0 and a.latest() is None
    a.record(5, "127.0.0.1:19000", 1, "accepted", "toml")
    a.record(5, "127.0.0.1:19000", 1, "committed", "toml")
    a.record(3, "127.0.0.1:19000", 0, "aborted", "old", reason="stage-1 failed")
    row = a.latest()
    assert row is not None and (row.epoch, row.state) == (5, "committed")
    with pytest.raises(ValueError, match="unknown assignment state"):
        a.record(6, "x", 0, "happy", "")


def older(path: Path, version: int) -> sqlite_utils.Database:
    """A database at ``path`` as release ``version`` of the schema left it, with plan 7."""
    from mlxceld.state.db import MIGRATIONS

    old = sqlite_utils.Database(sqlite3.connect(path, isolation_level=None))
    for migration in MIGRATIONS[:version]:
        migration(old)
    old.execute(f"PRAGMA user_version = {version}")
    Plans(old).create(7, "c", "ab" * 32, ("127.0.0.2:19000",), "toml")
    return old


def test_a_v5_database_keeps_its_rows_and_can_record_deactivated(tmp_path: Path) -> None:
    """Migration v6 rebuilds both tables (a CHECK cannot change in place)."""
    path = tmp_path / "state.db"
    old = older(path, 5)
    Plans(old).decide(7, "active", "every stage of 1 is active")
    Assignments(old).record(7, "127.0.0.1:19000", 0, "active", "toml")
    with pytest.raises(sqlite3.IntegrityError):  # what v6 is for
        old.execute("UPDATE plans SET decision = 'deactivated'")
    old.conn.close()

    db = open_db(path)
    plans, assignments = Plans(db), Assignments(db)
    row = plans.get(7)
    assert row is not None and (row.decision, row.summary) == ("active",
                                                               "every stage of 1 is active")
    plans.decide(7, "deactivated", "mlxctl cluster deactivate")
    assignments.record(7, "127.0.0.1:19000", 0, "deactivated", "toml", "by 127.0.0.1:19000")
    assert plans.latest().decision == "deactivated"  # type: ignore[union-attr]
    got = assignments.get(7)
    assert got is not None and (got.state, got.reason) == ("deactivated", "by 127.0.0.1:19000")
    assert assignments.get(8) is None
    names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert not {"plans_v5", "assignments_v5"} & names


def test_the_plan_to_resume_is_the_newest_that_took_over(tmp_path: Path) -> None:
    """A heal's push that aborted (or one never decided) after an active plan leaves the
    active one to resume; a plan deactivated after it ends the search."""
    plans = Plans(open_db(tmp_path / "state.db"))
    assert plans.resumable() is None

    def plan(epoch: int, decision: str | None) -> None:
        plans.create(epoch, "c", "ab" * 32, ("p",), "")
        if decision is not None:
            plans.decide(epoch, decision)

    plan(1, "abort")
    assert plans.resumable() is None
    plan(2, "active")
    plan(3, "abort")  # the heal's push, aborted
    plan(4, None)  # a push cut short before its decision
    row = plans.resumable()
    assert row is not None and (row.epoch, row.decision) == (2, "active")
    assert plans.standing() == row  # what `mlxctl cluster deactivate` ends
    latest = plans.latest()
    assert latest is not None and latest.epoch == 4
    plan(5, "activate")  # a heal decided: it took over
    assert (plans.resumable() or row).epoch == 5
    plans.decide(2, "deactivated")  # the superseded plan, recorded as such
    plans.decide(5, "deactivated")  # and then the operator's deactivate
    plan(6, "abort")
    assert plans.resumable() is None
    standing = plans.standing()  # deactivated: told again by another deactivate
    assert standing is not None and (standing.epoch, standing.decision) == (5, "deactivated")


def test_a_plan_keeps_its_mesh_and_a_v9_plan_reads_none(tmp_path: Path) -> None:
    """Migration v10 adds the --mesh a plan was planned with; a plan recorded before it
    reads None (not known), a new one its mesh across a reopen."""
    path = tmp_path / "state.db"
    older(path, 9).conn.close()
    plans = Plans(open_db(path))
    assert plans.get(7).mesh is None  # type: ignore[union-attr]
    plans.create(8, "c", "ab" * 32, ("127.0.0.2:19000", "127.0.0.3:19000"), "toml", "tp")
    assert Plans(open_db(path)).get(8).mesh == "tp"  # type: ignore[union-attr]
