"""A damaged state database is refused, naming the file and the way out, and is only ever
moved aside (``--reset-state``), never repaired, replaced or deleted."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from mlxceld.errors import DamagedState, StateError
from mlxceld.state import EventLog, claim_node, open_db, open_state, state_errors
from mlxceld.state.db import move_aside
from mlxceld.state.startup import start_state

from helpers.damage import scribble_pages


def filled(path: Path, events: int = 300) -> str:
    """A state database with a node and enough events for data pages; its node id."""
    database = open_db(path)
    try:
        node = claim_node(database)
        log = EventLog(database)
        for i in range(events):
            log.append("test.filler", "t", f"event {i} " + "x" * 200)
        return node.node_id
    finally:
        database.conn.close()  # the last connection: the WAL is folded into the file


def assert_damaged_hint(exc: DamagedState, path: Path) -> None:
    assert str(path) in exc.message and "is damaged" in exc.message
    assert "--reset-state" in exc.hint and f"{path.name}.damaged-" in exc.hint
    assert "never deleting" in exc.hint


def test_random_bytes_in_two_data_pages_are_damage(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    filled(path)
    before = path.read_bytes()
    scribble_pages(path)
    damaged = path.read_bytes()
    assert damaged != before
    with pytest.raises(DamagedState) as info:
        open_db(path)
    assert_damaged_hint(info.value, path)
    assert isinstance(info.value, StateError) and info.value.code == "state_damaged"
    assert path.read_bytes() == damaged  # left exactly as found


@pytest.mark.parametrize("seed", range(8))
def test_quick_check_finds_scribbled_pages_wherever_they_fall(tmp_path: Path,
                                                              seed: int) -> None:
    path = tmp_path / "state.db"
    filled(path, events=100)
    scribble_pages(path, seed=seed)
    with pytest.raises(DamagedState):
        open_db(path)


def test_a_zero_length_database_is_damaged_not_new(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.touch(mode=0o600)
    with pytest.raises(DamagedState) as info:
        open_db(path)
    assert_damaged_hint(info.value, path)
    assert "zero bytes" in info.value.message
    assert path.stat().st_size == 0


def test_a_file_that_is_no_database_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"not sqlite at all " * 512)
    with pytest.raises(DamagedState) as info:
        open_db(path)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


def test_state_errors_translates_at_the_seam(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"not sqlite at all " * 512)
    with pytest.raises(DamagedState) as info, state_errors(path):
        sqlite3.connect(path).execute("SELECT count(*) FROM sqlite_schema")
    assert info.value.message.startswith(f"state database {path} is damaged")
    with pytest.raises(StateError) as other, state_errors(path):
        sqlite3.connect(":memory:").execute("SELECT * FROM missing")
    assert not isinstance(other.value, DamagedState)  # a plain failure is not damage
    assert other.value.message == f"state database {path} cannot be used: no such table: missing"
    assert isinstance(other.value.__cause__, sqlite3.OperationalError)


def test_reset_moves_the_damaged_set_aside_and_starts_a_new_node(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    old_node = filled(path)
    scribble_pages(path)
    wal = Path(f"{path}-wal")
    wal.write_bytes(b"some wal frames")
    content = path.read_bytes()
    database, aside = open_state(path, reset=True)
    try:
        assert claim_node(database).node_id != old_node
    finally:
        database.conn.close()
    assert aside is not None and aside.parent == tmp_path
    assert aside.name.startswith("state.db.damaged-") and aside.name.endswith("Z")
    assert aside.read_bytes() == content
    assert Path(f"{aside}-wal").read_bytes() == b"some wal frames"  # the set stays a set
    assert stat.S_IMODE(aside.stat().st_mode) == 0o600


def test_without_reset_a_damaged_database_stays_where_it_is(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.touch()
    with pytest.raises(DamagedState):
        open_state(path, reset=False)
    assert os.listdir(tmp_path) == ["state.db"]


def test_reset_keeps_a_sound_database(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    node = filled(path, events=1)
    database, aside = open_state(path, reset=True)
    try:
        assert aside is None and claim_node(database).node_id == node
    finally:
        database.conn.close()
    assert not [p for p in tmp_path.iterdir() if ".damaged-" in p.name]


def test_move_aside_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    names = []
    for content in (b"first", b"second", b"third"):
        path.write_bytes(content)
        names.append(move_aside(path, now=0.0))
    assert [n.name for n in names] == ["state.db.damaged-19700101T000000Z",
                                       "state.db.damaged-19700101T000000Z.2",
                                       "state.db.damaged-19700101T000000Z.3"]
    assert [n.read_bytes() for n in names] == [b"first", b"second", b"third"]
    assert not path.exists()


def test_the_start_after_a_reset_says_so_in_an_event(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    old_node = filled(path, events=50)
    scribble_pages(path)
    state = start_state(path, reset=True)
    try:
        assert state.node.node_id != old_node
        [event] = [e for e in state.events.since(0, 1000) if e.kind == "state.reset"]
        aside = event.data["moved_to"]
        assert aside.startswith(f"{path}.damaged-") and Path(aside).exists()
        assert event.data["node_id"] == state.node.node_id
        assert f"moved aside to {aside}" in event.message
    finally:
        state.db.conn.close()
