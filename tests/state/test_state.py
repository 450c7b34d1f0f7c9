"""The daemon's SQLite state, for real, in a temp dir: schema, tables, events, node, lock."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import stat
import time
from pathlib import Path

import pytest
import sqlite_utils

from mlxceld.errors import AlreadyRunning, DaemonError, StateError
from mlxceld.state import (
    SCHEMA_VERSION,
    EventLog,
    WorkerRow,
    WorkersTable,
    claim_node,
    lock,
    open_db,
)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


def user_version(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        version: int = conn.execute("PRAGMA user_version").fetchone()[0]
        return version


# -- open_db ---------------------------------------------------------------------------------------


def test_open_db_creates_the_file_0600_in_wal_mode(db: sqlite_utils.Database,
                                                   db_path: Path) -> None:
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert {"node", "workers", "events"} <= set(db.table_names())


def test_reopening_is_idempotent(db_path: Path) -> None:
    for _ in range(3):
        database = open_db(db_path)
        try:
            WorkersTable(database).put(f"w{_}", role="echo", spec={}, desired="running")
        finally:
            database.conn.close()
    assert user_version(db_path) == SCHEMA_VERSION
    database = open_db(db_path)
    try:
        assert [w.name for w in WorkersTable(database).all()] == ["w0", "w1", "w2"]
    finally:
        database.conn.close()


def test_newer_schema_is_refused_naming_the_path(db_path: Path) -> None:
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StateError) as info:
        open_db(db_path)
    assert str(db_path) in str(info.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in str(info.value)
    assert info.value.hint
    assert user_version(db_path) == SCHEMA_VERSION + 1  # left alone


def test_corrupt_file_is_a_state_error(db_path: Path) -> None:
    db_path.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(StateError) as info:
        open_db(db_path)
    assert str(db_path) in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.Error)


def test_missing_state_dir_is_a_state_error(tmp_path: Path) -> None:
    path = tmp_path / "absent" / "state.db"
    with pytest.raises(StateError, match="cannot be created") as info:
        open_db(path)
    assert str(path) in str(info.value)


# -- WorkersTable ----------------------------------------------------------------------------------


def test_workers_put_get_round_trip(db: sqlite_utils.Database) -> None:
    workers = WorkersTable(db)
    assert workers.get("w1") is None
    before = time.time()
    workers.put("w1", role="echo", spec={"options": {"a": 1}}, desired="running")
    row = workers.get("w1")
    assert row is not None
    assert (row.name, row.role, row.spec, row.desired) == ("w1", "echo", {"options": {"a": 1}},
                                                           "running")
    assert row.state == "exited"  # a new row starts down
    assert (row.reason, row.pid, row.restarts, row.last_exit) == ("", None, 0, "")
    assert row.updated_at is not None and row.updated_at >= before


def test_workers_put_with_extra_fields(db: sqlite_utils.Database) -> None:
    workers = WorkersTable(db)
    workers.put("w1", role="echo", spec={}, desired="stopped", state="running", pid=42)
    row = workers.get("w1")
    assert row is not None
    assert (row.state, row.pid, row.desired) == ("running", 42, "stopped")


def test_workers_update_changes_only_the_named_columns(db: sqlite_utils.Database) -> None:
    workers = WorkersTable(db)
    workers.put("w1", role="echo", spec={"x": 1}, desired="running")
    workers.update("w1", state="running", pid=1234, create_time=12.5, restarts=2,
                   last_exit="killed by SIGKILL", reason="ready")
    row = workers.get("w1")
    assert row is not None
    assert row == WorkerRow(
        name="w1", role="echo", spec={"x": 1}, desired="running", state="running",
        reason="ready", pid=1234, create_time=12.5, restarts=2, last_exit="killed by SIGKILL",
        last_exit_at=None, started_at=None, updated_at=row.updated_at,
    )


def test_workers_re_put_keeps_the_other_columns(db: sqlite_utils.Database) -> None:
    workers = WorkersTable(db)
    workers.put("w1", role="echo", spec={"v": 1}, desired="running")
    workers.update("w1", state="running", pid=77, restarts=3)
    workers.put("w1", role="echo", spec={"v": 2}, desired="stopped")
    row = workers.get("w1")
    assert row is not None
    assert (row.spec, row.desired) == ({"v": 2}, "stopped")
    assert (row.state, row.pid, row.restarts) == ("running", 77, 3)


def test_workers_all_is_sorted_and_delete_removes(db: sqlite_utils.Database) -> None:
    workers = WorkersTable(db)
    for name in ("zeta", "alpha", "mid"):
        workers.put(name, role="echo", spec={}, desired="running")
    assert [w.name for w in workers.all()] == ["alpha", "mid", "zeta"]
    workers.delete("mid")
    workers.delete("never-there")
    assert [w.name for w in workers.all()] == ["alpha", "zeta"]
    assert workers.get("mid") is None


def test_workers_survive_a_reopen(db_path: Path) -> None:
    first = open_db(db_path)
    try:
        WorkersTable(first).put("w1", role="echo", spec={"k": "v"}, desired="running", pid=9)
    finally:
        first.conn.close()
    second = open_db(db_path)
    try:
        row = WorkersTable(second).get("w1")
    finally:
        second.conn.close()
    assert row is not None and (row.spec, row.pid) == ({"k": "v"}, 9)


# -- EventLog --------------------------------------------------------------------------------------


@pytest.fixture
def events(db: sqlite_utils.Database) -> EventLog:
    log = EventLog(db)
    for i in range(1, 7):
        log.append("worker.state", "w1" if i % 2 else "w2", f"event {i}", n=i)
    return log


def test_append_returns_the_stored_event(db: sqlite_utils.Database) -> None:
    log = EventLog(db)
    event = log.append("daemon.started", "daemon", "started", pid=5, tags=["a"])
    assert event.id == 1
    assert (event.kind, event.subject, event.message) == ("daemon.started", "daemon", "started")
    assert event.data == {"pid": 5, "tags": ["a"]}
    (stored,) = log.since()
    assert stored == event
    assert stored.to_json() == {"id": 1, "ts": event.ts, "kind": "daemon.started",
                                "subject": "daemon", "message": "started",
                                "data": {"pid": 5, "tags": ["a"]}}


def test_since_positive_after_is_exclusive_and_oldest_first(events: EventLog) -> None:
    assert [e.id for e in events.since()] == [1, 2, 3, 4, 5, 6]
    assert [e.id for e in events.since(4)] == [5, 6]
    assert events.since(6) == []
    assert [e.data["n"] for e in events.since(2)] == [3, 4, 5, 6]


def test_since_negative_after_means_the_last_n(events: EventLog) -> None:
    assert [e.id for e in events.since(-2)] == [5, 6]
    assert [e.id for e in events.since(-100)] == [1, 2, 3, 4, 5, 6]


def test_since_subject_filter(events: EventLog) -> None:
    assert [e.id for e in events.since(subject="w1")] == [1, 3, 5]
    assert [e.id for e in events.since(2, subject="w2")] == [4, 6]
    assert [e.id for e in events.since(-2, subject="w1")] == [3, 5]
    assert events.since(subject="nobody") == []


def test_since_limit(events: EventLog) -> None:
    assert [e.id for e in events.since(0, limit=2)] == [1, 2]
    assert [e.id for e in events.since(-5, limit=2)] == [5, 6]
    assert [e.id for e in events.since(0, limit=2, subject="w2")] == [2, 4]


def test_wait_wakes_up_when_an_event_is_appended(db: sqlite_utils.Database) -> None:
    log = EventLog(db)

    async def scenario() -> float:
        async def append_later() -> None:
            await asyncio.sleep(0.05)
            log.append("worker.started", "w1", "started")

        start = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            waiter = tg.create_task(log.wait(10.0))
            tg.create_task(append_later())
        await waiter
        return time.monotonic() - start

    assert asyncio.run(scenario()) < 2.0
    assert [e.kind for e in log.since()] == ["worker.started"]


def test_wait_times_out_without_events(db: sqlite_utils.Database) -> None:
    log = EventLog(db)

    async def scenario() -> float:
        start = time.monotonic()
        await log.wait(0.1)
        return time.monotonic() - start

    elapsed = asyncio.run(scenario())
    assert 0.09 <= elapsed < 2.0


def test_wait_after_an_append_waits_for_the_next_one(db: sqlite_utils.Database) -> None:
    log = EventLog(db)
    log.append("a", "x", "before anyone waited")

    async def scenario() -> float:
        start = time.monotonic()
        await log.wait(0.1)
        return time.monotonic() - start

    assert asyncio.run(scenario()) >= 0.09


# -- Node ------------------------------------------------------------------------------------------


def test_claim_node_keeps_the_node_id(db_path: Path) -> None:
    database = open_db(db_path)
    try:
        first = claim_node(database)
        again = claim_node(database)
    finally:
        database.conn.close()
    database = open_db(db_path)
    try:
        reopened = claim_node(database)
        (row,) = database["node"].rows
    finally:
        database.conn.close()
    assert first == again == reopened
    assert first.node_id.startswith(first.hostname.split(".")[0] + "-")
    assert row["node_id"] == first.node_id
    assert row["daemon_pid"] == os.getpid()


def test_separate_databases_get_different_node_ids(tmp_path: Path) -> None:
    ids = []
    for name in ("a.db", "b.db"):
        database = open_db(tmp_path / name)
        try:
            ids.append(claim_node(database).node_id)
        finally:
            database.conn.close()
    assert ids[0] != ids[1]


# -- Lock ------------------------------------------------------------------------------------------


def test_lock_file_is_0600_and_holds_our_pid(tmp_path: Path) -> None:
    held = lock.acquire(tmp_path)
    try:
        assert held.path == tmp_path / lock.LOCK_NAME
        assert stat.S_IMODE(held.path.stat().st_mode) == 0o600
        assert held.path.read_text() == f"{os.getpid()}\n"
    finally:
        held.release()


def test_second_acquire_is_refused_naming_the_pid(tmp_path: Path) -> None:
    held = lock.acquire(tmp_path)
    try:
        with pytest.raises(AlreadyRunning) as info:
            lock.acquire(tmp_path)
        assert f"pid {os.getpid()}" in str(info.value)
        assert str(tmp_path) in str(info.value)
        assert str(os.getpid()) in info.value.hint
    finally:
        held.release()


def test_the_lock_file_names_the_holders_socket_for_the_next_daemon(tmp_path: Path) -> None:
    socket = Path("/run/mx/ctl.sock")
    held = lock.acquire(tmp_path, socket)
    try:
        assert held.path.read_text() == f"{os.getpid()}\n{socket}\n"
        with pytest.raises(AlreadyRunning) as info:
            lock.acquire(tmp_path, Path("/run/other.sock"))
        assert (info.value.pid, info.value.socket) == (os.getpid(), socket)
        assert f"kill -TERM {os.getpid()}" in info.value.hint
    finally:
        held.release()


@pytest.mark.parametrize("content", [b"", b"garbage\n", b"12x\nrelative/path\n", b"\xff\xfe"])
def test_a_garbled_lock_file_still_gives_a_refusal(tmp_path: Path, content: bytes) -> None:
    held = lock.acquire(tmp_path)
    try:
        held.path.write_bytes(content)  # what the holder wrote, overwritten
        with pytest.raises(AlreadyRunning) as info:
            lock.acquire(tmp_path)
        assert (info.value.pid, info.value.socket) == (None, None)
        assert "(pid unknown)" in info.value.message
    finally:
        held.release()


def test_release_then_acquire_works(tmp_path: Path) -> None:
    lock.acquire(tmp_path).release()
    again = lock.acquire(tmp_path)
    again.release()
    again.release()  # twice is harmless


def test_stale_pid_in_the_lock_file_is_replaced(tmp_path: Path) -> None:
    (tmp_path / lock.LOCK_NAME).write_text("999999999\nleftover garbage\n")
    held = lock.acquire(tmp_path)
    try:
        assert held.path.read_text() == f"{os.getpid()}\n"
    finally:
        held.release()


def test_lock_in_a_missing_dir_is_a_daemon_error(tmp_path: Path) -> None:
    with pytest.raises(DaemonError, match="cannot open lock file"):
        lock.acquire(tmp_path / "absent")


def test_trim_keeps_the_newest_events(tmp_path: Path) -> None:
    db = open_db(tmp_path / "state.db")
    log = EventLog(db)
    for i in range(30):
        log.append("test.event", "t", f"event {i}")
    assert log.trim(keep=10) == 20
    kept = log.since(0, limit=100)
    assert [e.message for e in kept] == [f"event {i}" for i in range(20, 30)]
    assert log.trim(keep=10) == 0
    db.close()
