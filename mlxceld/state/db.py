"""Open the daemon's SQLite file (WAL), check it, and bring its schema up to date.

The schema version lives in ``PRAGMA user_version``; each migration is a
function applied once, in order, inside one transaction. A database written by
a newer mlxceld is refused rather than guessed at.

This is where ``sqlite3.Error`` becomes ours: ``open_db`` and ``state_errors``
translate it into ``StateError``, and into ``DamagedState`` where SQLite says the
file is corrupt or is not a database. An existing file is checked at every open
(``PRAGMA quick_check``: every page and record is read; about 12 ms for a 5 MB
database of 20,000 events, some tens of ms for a full event log); a
zero-length one is damaged too, never taken for a new node
(its history and node id would be lost without a word). A damaged database is
never repaired, replaced or deleted here: ``open_state(reset=True)``
(``mlxceld --reset-state``) moves it aside, with its ``-wal`` and ``-shm``, to
``state.db.damaged-<UTC time>``, and opens a new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import sqlite_utils

from mlxceld.errors import DamagedState, StateError

log = logging.getLogger(__name__)

Migration = Callable[[sqlite_utils.Database], None]


def _v1(db: sqlite_utils.Database) -> None:
    db.table("node").create(
        {"id": int, "node_id": str, "created_at": float, "version": str, "hostname": str,
         "daemon_pid": int, "started_at": float},
        pk="id",
    )
    db.table("workers").create(
        {"name": str, "role": str, "spec": str, "desired": str, "state": str, "reason": str,
         "pid": int, "create_time": float, "restarts": int, "last_exit": str,
         "last_exit_at": float, "started_at": float, "updated_at": float},
        pk="name", not_null={"role", "spec", "desired", "state"},
    )
    db.table("events").create(
        {"id": int, "ts": float, "kind": str, "subject": str, "message": str, "data": str},
        pk="id", not_null={"ts", "kind", "message"},
    )
    db.table("events").create_index(["subject"])


def _v2(db: sqlite_utils.Database) -> None:
    """Settings changed at run time (``mlxctl serve``): key -> JSON value."""
    db.table("settings").create({"key": str, "value": str, "updated_at": float}, pk="key")


def _v3(db: sqlite_utils.Database) -> None:
    """Cluster secrets by key id (hex). The secrets live in 0600 files, never here.

    'retired' is reserved for rotation; at most one row is the primary.
    """
    db.execute(
        "CREATE TABLE keys ("
        " key_id TEXT PRIMARY KEY CHECK (length(key_id) = 16),"
        " state TEXT NOT NULL CHECK (state IN ('primary', 'installed', 'retired')),"
        " created_at REAL NOT NULL,"
        " source TEXT NOT NULL)"
    )
    db.execute("CREATE UNIQUE INDEX keys_one_primary ON keys (state) WHERE state = 'primary'")


def _v4(db: sqlite_utils.Database) -> None:
    """Discovery's candidate peers by agent address (``mlxceld.discovery.candidates``).

    ``inventory`` is the JSON of the peer's last inventory reply; ``record_ts`` the
    ``ts`` of its newest valid mDNS record (freshness); ``error`` the last failure.
    """
    db.execute(
        "CREATE TABLE peers ("
        " address TEXT PRIMARY KEY,"
        " source TEXT NOT NULL CHECK (source IN ('static', 'mdns')),"
        " state TEXT NOT NULL"
        "  CHECK (state IN ('discovered', 'reachable', 'unreachable', 'refused')),"
        " node_id TEXT, version TEXT, key_id TEXT,"
        " memory_total INTEGER, memory_available INTEGER,"
        " error TEXT, last_seen REAL, record_ts INTEGER, inventory TEXT,"
        " updated_at REAL NOT NULL)"
    )


def _v5(db: sqlite_utils.Database) -> None:
    """The two-phase assignment: the coordinator's plans, a peer's assignments."""
    from mlxceld.state.plans import create_tables

    create_tables(db)


def _v6(db: sqlite_utils.Database) -> None:
    """A plan and an assignment can be deactivated (`mlxctl cluster deactivate`)."""
    from mlxceld.state.plans import allow_deactivated

    allow_deactivated(db)


def _v7(db: sqlite_utils.Database) -> None:
    """The failure detector's state per peer (``state/liveness.py``)."""
    from mlxceld.state.liveness import create_table

    create_table(db)


def _v8(db: sqlite_utils.Database) -> None:
    """Nodes being drained (`mlxctl drain`; ``state/drains.py``)."""
    from mlxceld.state.drains import create_table

    create_table(db)


def _v9(db: sqlite_utils.Database) -> None:
    """Cluster-wide secret rotations (`mlxctl secret rotate`; ``state/rotations.py``)."""
    from mlxceld.state.rotations import create_table

    create_table(db)


def _v10(db: sqlite_utils.Database) -> None:
    """The --mesh a plan was planned with (a resume reports a change of it)."""
    from mlxceld.state.plans import add_mesh

    add_mesh(db)


MIGRATIONS: list[Migration] = [_v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9, _v10]
SCHEMA_VERSION = len(MIGRATIONS)


STATE_DB = "state.db"  # the file's name in the state dir
DAMAGED_MARK = ".damaged-"
_DAMAGE_CODES = ("SQLITE_CORRUPT", "SQLITE_NOTADB")  # and their extended codes
_SIDE_FILES = ("-wal", "-shm")
_CHECK_LINES = 5  # quick_check stops after this many problems; they go into the message


def open_db(path: Path) -> sqlite_utils.Database:
    """Open (creating if needed, mode 0600), check and migrate. Raises ``DamagedState``
    for a damaged file and ``StateError`` for any other failure, both naming the file."""
    if not _create(path):
        _check(path)
    try:
        conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    except sqlite3.Error as exc:
        raise translate(exc, path) from exc
    try:
        db = sqlite_utils.Database(conn)
        db.enable_wal()
        conn.execute("PRAGMA synchronous=NORMAL")
        migrate(db, path)
        return db
    except BaseException as exc:
        conn.close()
        if not isinstance(exc, sqlite3.Error):
            raise
        raise translate(exc, path) from exc


def open_state(path: Path, *, reset: bool) -> tuple[sqlite_utils.Database, Path | None]:
    """``open_db``; with ``reset`` a damaged database is moved aside (never deleted) and a
    new one opened. Returns the database and where the damaged one went (None: none did)."""
    try:
        return open_db(path), None
    except DamagedState as exc:
        if not reset:
            raise
        aside = move_aside(path)
        log.error("%s: moved aside to %s (--reset-state)", exc.message, aside)
        return open_db(path), aside


def translate(exc: sqlite3.Error, path: Path) -> StateError:
    """``exc`` as ours: ``DamagedState`` where SQLite says the file is corrupt or is no
    database, else ``StateError``; both name ``path`` and what to do."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name.startswith(_DAMAGE_CODES):
        return damaged(path, str(exc))
    return StateError(f"state database {path} cannot be used: {exc}",
                      hint="check the file, its permissions and the free space on its disk")


@contextlib.contextmanager
def state_errors(path: Path) -> Iterator[None]:
    """Translate any ``sqlite3.Error`` raised inside (as ``translate`` does)."""
    try:
        yield
    except sqlite3.Error as exc:
        raise translate(exc, path) from exc


def damaged(path: Path, detail: str) -> DamagedState:
    return DamagedState(
        f"state database {path} is damaged ({detail})",
        hint=f"restore it from a backup, or start mlxceld once with --reset-state: it moves "
        f"the file aside to {path.name}{DAMAGED_MARK}<time> (never deleting it) and starts "
        "this daemon as a new node (new node id, no history)")


def move_aside(path: Path, now: float | None = None) -> Path:
    """Rename ``path`` (and its ``-wal`` and ``-shm``, so that SQLite can still open the
    set) to ``<name>.damaged-<UTC time>``, a free name; return the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    base = path.with_name(f"{path.name}{DAMAGED_MARK}{stamp}")
    aside, n = base, 1
    while any(Path(f"{aside}{side}").exists() for side in ("", *_SIDE_FILES)):
        n += 1
        aside = base.with_name(f"{base.name}.{n}")
    try:
        for side in _SIDE_FILES:  # the side files first: the main file names the set
            if Path(f"{path}{side}").exists():
                os.rename(f"{path}{side}", f"{aside}{side}")
        os.rename(path, aside)
    except OSError as exc:
        raise StateError(f"state database {path} cannot be moved aside to {aside}: "
                         f"{exc.strerror}",
                         hint="check the state dir's owner, permissions and free space; or "
                         "move the file away yourself") from exc
    return aside


def _create(path: Path) -> bool:
    """Create ``path`` (0600) if it is not there; True if it was created. An existing
    zero-length file is damaged: a database always has its header page."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            empty = os.stat(path).st_size == 0
        except OSError as exc:
            raise StateError(f"state database {path} cannot be read: {exc.strerror}",
                             hint="check the state dir's owner and permissions") from exc
        if empty:
            raise damaged(path, "the file is empty: zero bytes") from None
        return False
    except OSError as exc:
        raise StateError(f"state database {path} cannot be created: {exc.strerror}",
                         hint="check the state dir's owner and permissions") from exc
    os.close(fd)
    return True


def _check(path: Path) -> None:
    """``PRAGMA quick_check`` on a read-only connection (which never checkpoints or removes
    a ``-wal``: the files stay as found): ``DamagedState`` with its first findings."""
    try:
        with contextlib.closing(sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro",
                                                uri=True, timeout=5.0)) as conn:
            found = [str(row[0]) for row in conn.execute(f"PRAGMA quick_check({_CHECK_LINES})")]
    except sqlite3.Error as exc:
        raise translate(exc, path) from exc
    if found != ["ok"]:
        detail = " ".join("; ".join(found).split())  # on one line
        raise damaged(path, f"quick_check: {detail[:400]}")


def migrate(db: sqlite_utils.Database, path: Path) -> None:
    current = db.execute("PRAGMA user_version").fetchone()[0]
    if current > SCHEMA_VERSION:
        raise StateError(
            f"state database {path} has schema version {current}, newer than this mlxceld "
            f"understands ({SCHEMA_VERSION})",
            hint="run the newer mlxceld, or point --state-dir elsewhere",
        )
    for version in range(current, SCHEMA_VERSION):
        with db.conn:
            db.conn.execute("BEGIN")
            MIGRATIONS[version](db)
            db.conn.execute(f"PRAGMA user_version = {version + 1}")
