"""The ``drains`` table: the nodes being drained or drained (`mlxctl drain`), kept across
restarts.

One row per node id: ``draining`` (new requests that need the node are refused, the
ones running finish until ``deadline``) or ``drained`` (none runs any more; new ones
are still refused); `mlxctl undrain` deletes the row. ``finished`` and ``ended`` count
the requests that ran to their end during the drain and those its deadline ended. How
the states change is ``mlxceld.drain``'s business; every change is also an event
(``drain.started``, ``drain.drained``, ``drain.ended``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import sqlite_utils

from mlxceld.types import JSON

DrainState = Literal["draining", "drained"]
DRAIN_STATES: tuple[DrainState, ...] = ("draining", "drained")


@dataclass(frozen=True)
class DrainRow:
    node_id: str  # the key
    state: DrainState
    started_at: float  # unix s
    deadline: float | None  # unix s; None: no deadline (until undrained)
    force: bool  # --force: the deadline was the drain's start
    updated_at: float
    reason: str = ""  # the last change, in a line
    finished: int = 0  # requests that ran to their end while it drained
    ended: int = 0  # requests its deadline ended

    def to_json(self) -> JSON:
        return asdict(self)


def create_table(db: sqlite_utils.Database) -> None:
    """Migration v8 (see db.py)."""
    states = ", ".join(f"'{s}'" for s in DRAIN_STATES)
    db.execute(
        "CREATE TABLE drains ("
        " node_id TEXT PRIMARY KEY,"
        f" state TEXT NOT NULL CHECK (state IN ({states})),"
        " started_at REAL NOT NULL, deadline REAL, force INTEGER NOT NULL,"
        " updated_at REAL NOT NULL, reason TEXT NOT NULL,"
        " finished INTEGER NOT NULL, ended INTEGER NOT NULL)")


class DrainsTable:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db

    def all(self) -> list[DrainRow]:
        return [_row(r) for r in self._db.table("drains").rows_where(order_by="node_id")]

    def get(self, node_id: str) -> DrainRow | None:
        rows = list(self._db.table("drains").rows_where("node_id = ?", [node_id]))
        return _row(rows[0]) if rows else None

    def put(self, row: DrainRow) -> None:
        self._db.table("drains").upsert(asdict(row), pk="node_id")

    def delete(self, node_id: str) -> None:
        self._db.table("drains").delete_where("node_id = ?", [node_id])


def _row(r: dict[str, Any]) -> DrainRow:
    return DrainRow(**{**r, "force": bool(r["force"])})
