"""The ``workers`` table: each supervised worker's desired and observed state.

This is what a restarted daemon reads to re-adopt running workers: the pid and
the process start time identify the process without trusting a reused pid.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import sqlite_utils
from sqlite_utils.db import NotFoundError

from mlxceld.types import JSON


@dataclass(frozen=True)
class WorkerRow:
    name: str
    role: str
    spec: JSON
    desired: str  # "running" | "stopped"
    state: str
    reason: str = ""
    pid: int | None = None
    create_time: float | None = None
    restarts: int = 0
    last_exit: str = ""
    last_exit_at: float | None = None
    started_at: float | None = None
    updated_at: float | None = None


class WorkersTable:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db

    def get(self, name: str) -> WorkerRow | None:
        try:
            row = self._db.table("workers").get(name)
        except NotFoundError:
            return None
        return _row(row)

    def all(self) -> list[WorkerRow]:
        return [_row(r) for r in self._db.table("workers").rows_where(order_by="name")]

    def put(self, name: str, *, role: str, spec: JSON, desired: str, **fields: Any) -> None:
        """Insert or replace the worker's identity columns (keeps the others)."""
        row = {"name": name, "role": role, "spec": json.dumps(spec, sort_keys=True),
               "desired": desired, "updated_at": time.time(), **fields}
        if self.get(name) is None:
            self._db.table("workers").insert({"state": "exited", **row})
        else:
            self._db.table("workers").update(name, row)

    def update(self, name: str, **fields: Any) -> None:
        """Change some columns of an existing worker's row."""
        self._db.table("workers").update(name, {**fields, "updated_at": time.time()})

    def delete(self, name: str) -> None:
        self._db.table("workers").delete_where("name = ?", [name])


def _row(r: dict[str, Any]) -> WorkerRow:
    return WorkerRow(
        name=r["name"], role=r["role"], spec=json.loads(r["spec"]), desired=r["desired"],
        state=r["state"], reason=r["reason"] or "", pid=r["pid"], create_time=r["create_time"],
        restarts=r["restarts"] or 0, last_exit=r["last_exit"] or "",
        last_exit_at=r["last_exit_at"], started_at=r["started_at"], updated_at=r["updated_at"],
    )
