"""The ``peers`` table: discovery's candidate peers, kept across daemon restarts.

One row per peer agent address. What the columns mean, and how a row changes,
is ``mlxceld.discovery.candidates``'s business; this module only stores them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

import sqlite_utils

from mlxceld.types import JSON

PeerSource = Literal["static", "mdns"]
PeerState = Literal["discovered", "reachable", "unreachable", "refused"]


@dataclass(frozen=True)
class PeerRow:
    address: str  # the peer's agent host:port (normalized), the key
    source: PeerSource
    state: PeerState
    updated_at: float
    node_id: str | None = None
    version: str | None = None  # package version
    key_id: str | None = None  # hex: the record's kid, or the key the handshake used
    memory_total: int | None = None
    memory_available: int | None = None
    error: str | None = None  # the last failure ("kind: message"), None when reachable
    last_seen: float | None = None  # last valid record or inventory answer (unix s)
    record_ts: int | None = None  # ts of the newest valid mDNS record
    inventory: JSON | None = None  # the last inventory reply

    def to_json(self) -> JSON:
        return asdict(self)


class PeersTable:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db

    def all(self) -> list[PeerRow]:
        return [_row(r) for r in self._db.table("peers").rows_where(order_by="address")]

    def put(self, row: PeerRow) -> None:
        values = asdict(row)
        values["inventory"] = (json.dumps(row.inventory, sort_keys=True)
                               if row.inventory is not None else None)
        self._db.table("peers").upsert(values, pk="address")

    def delete(self, address: str) -> None:
        self._db.table("peers").delete_where("address = ?", [address])


def _row(r: dict[str, Any]) -> PeerRow:
    inventory = json.loads(r["inventory"]) if r["inventory"] else None
    return PeerRow(**{**r, "inventory": inventory})
