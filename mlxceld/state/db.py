"""Open the daemon's SQLite file (WAL) and bring its schema up to date.

The schema version lives in ``PRAGMA user_version``; each migration is a
function applied once, in order, inside one transaction. A database written by
a newer mlxceld is refused rather than guessed at.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import sqlite_utils

from mlxceld.errors import StateError

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


MIGRATIONS: list[Migration] = [_v1, _v2, _v3, _v4, _v5, _v6]
SCHEMA_VERSION = len(MIGRATIONS)


def open_db(path: Path) -> sqlite_utils.Database:
    """Open (creating if needed, mode 0600) and migrate. Raises StateError naming the file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    except OSError as exc:
        raise StateError(f"state database {path} cannot be created: {exc.strerror}",
                         hint="check the state dir's owner and permissions") from exc
    except sqlite3.Error as exc:
        raise StateError(f"state database {path} cannot be opened: {exc}",
                         hint="check the file and its permissions") from exc
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
        raise StateError(
            f"state database {path} cannot be opened: {exc}",
            hint="check the file; a corrupt database can be moved aside and the daemon restarted",
        ) from exc


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
