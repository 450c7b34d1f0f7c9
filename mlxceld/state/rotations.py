"""The ``rotations`` table: cluster-wide secret rotations (`mlxctl secret rotate`).

One row per rotation: the key ids from and to (hex; the new secret itself is installed
in this node's keyring, a 0600 file under ``<state-dir>/keys``, never here), the
members (a JSON list of agent addresses), the step it is at (``cluster/rotation_round.py``)
and, once failed, what each member that failed a step said (a JSON object). A rotation
whose step is neither ``done`` nor ``failed`` is resumed when the daemon starts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import sqlite_utils

from mlxceld.types import JSON

STEPS = ("installing", "verifying_install", "using", "verifying_use", "removing", "done",
         "failed")
FINISHED = ("done", "failed")


@dataclass(frozen=True)
class RotationRow:
    id: int
    old_kid: str
    new_kid: str
    members: tuple[str, ...]
    step: str
    failures: dict[str, str]
    started_at: float
    updated_at: float

    @property
    def finished(self) -> bool:
        return self.step in FINISHED

    def to_json(self) -> JSON:
        return {"id": self.id, "old_key_id": self.old_kid, "new_key_id": self.new_kid,
                "members": list(self.members), "step": self.step,
                "failures": dict(self.failures), "started_at": self.started_at,
                "updated_at": self.updated_at}


def create_table(db: sqlite_utils.Database) -> None:
    """Migration v9 (see db.py)."""
    steps = ", ".join(f"'{s}'" for s in STEPS)
    db.execute(
        "CREATE TABLE rotations ("
        " id INTEGER PRIMARY KEY,"
        " old_kid TEXT NOT NULL CHECK (length(old_kid) = 16),"
        " new_kid TEXT NOT NULL CHECK (length(new_kid) = 16),"
        " members TEXT NOT NULL,"
        f" step TEXT NOT NULL CHECK (step IN ({steps})),"
        " failures TEXT NOT NULL,"
        " started_at REAL NOT NULL, updated_at REAL NOT NULL)")


class RotationsTable:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db

    def latest(self) -> RotationRow | None:
        rows = list(self._db.table("rotations").rows_where(order_by="id desc", limit=1))
        return _row(rows[0]) if rows else None

    def begin(self, old_kid: str, new_kid: str, members: tuple[str, ...]) -> RotationRow:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO rotations (old_kid, new_kid, members, step, failures, started_at,"
            " updated_at) VALUES (?, ?, ?, 'installing', '{}', ?, ?)",
            [old_kid, new_kid, json.dumps(list(members)), now, now])
        row = self.get(int(cur.lastrowid or 0))
        assert row is not None
        return row

    def get(self, rotation_id: int) -> RotationRow | None:
        rows = list(self._db.table("rotations").rows_where("id = ?", [rotation_id]))
        return _row(rows[0]) if rows else None

    def set_step(self, rotation_id: int, step: str, failures: dict[str, str]) -> None:
        self._db.execute("UPDATE rotations SET step = ?, failures = ?, updated_at = ?"
                         " WHERE id = ?", [step, json.dumps(failures), time.time(), rotation_id])


def _row(r: dict[str, Any]) -> RotationRow:
    return RotationRow(r["id"], r["old_kid"], r["new_kid"], tuple(json.loads(r["members"])),
                       r["step"], dict(json.loads(r["failures"])), r["started_at"],
                       r["updated_at"])
