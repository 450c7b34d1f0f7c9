"""The two-phase assignment's tables: plans (coordinator) and assignments (peer)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
