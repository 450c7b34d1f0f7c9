"""The ``liveness`` table: the failure detector's verdict on each peer, kept across restarts.

One row per peer agent address: its state (``unknown``, ``alive``, ``suspect``,
``dead``), since when (unix s) and why, and when it last answered a ping. What the
states mean and how they change is ``mlxceld.discovery.detector``'s business; every
change is also an event (``peer.alive``, ``peer.suspect``, ``peer.dead``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import sqlite_utils

from mlxceld.types import JSON

LivenessState = Literal["unknown", "alive", "suspect", "dead"]
LIVENESS_STATES: tuple[LivenessState, ...] = ("unknown", "alive", "suspect", "dead")


@dataclass(frozen=True)
class LivenessRow:
    address: str  # the peer's agent host:port (normalized), the key
    state: LivenessState
    since: float  # when it entered ``state`` (unix s)
    reason: str  # why, in a line
    updated_at: float
    node_id: str | None = None  # as discovery knows it, when it does
    last_answer: float | None = None  # its last pong (unix s)

    def to_json(self) -> JSON:
        return asdict(self)


def create_table(db: sqlite_utils.Database) -> None:
    """Migration v7 (see db.py)."""
    states = ", ".join(f"'{s}'" for s in LIVENESS_STATES)
    db.execute(
        "CREATE TABLE liveness ("
        " address TEXT PRIMARY KEY,"
        f" state TEXT NOT NULL CHECK (state IN ({states})),"
        " since REAL NOT NULL, reason TEXT NOT NULL, node_id TEXT, last_answer REAL,"
        " updated_at REAL NOT NULL)")


class LivenessTable:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db

    def all(self) -> list[LivenessRow]:
        return [_row(r) for r in self._db.table("liveness").rows_where(order_by="address")]

    def put(self, row: LivenessRow) -> None:
        self._db.table("liveness").upsert(asdict(row), pk="address")

    def delete(self, address: str) -> None:
        self._db.table("liveness").delete_where("address = ?", [address])


def _row(r: dict[str, Any]) -> LivenessRow:
    return LivenessRow(**r)
