"""The append-only ``events`` table, with a wake-up for followers (``mlxctl events -f``)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import sqlite_utils

from mlxceld.types import JSON

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str  # e.g. "worker.exited", "daemon.started"
    subject: str  # the entity: a worker name, "daemon", ...
    message: str
    data: JSON

    def to_json(self) -> JSON:
        return asdict(self)


KEEP_EVENTS = 100_000  # retention: the newest this many, trimmed when the daemon starts


class EventLog:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db
        self._changed = asyncio.Event()

    def trim(self, keep: int = KEEP_EVENTS) -> int:
        """Drop all but the newest ``keep`` events (append-only otherwise); return how many."""
        cursor = self._db.execute(
            "delete from events where id <= (select max(id) from events) - ?", [keep])
        return int(cursor.rowcount or 0)

    def append(self, kind: str, subject: str, message: str, **data: Any) -> Event:
        ts = time.time()
        table = self._db.table("events")
        table.insert({"ts": ts, "kind": kind, "subject": subject, "message": message,
                      "data": json.dumps(data, sort_keys=True)})
        event = Event(int(table.last_rowid or 0), ts, kind, subject, message, data)
        self._changed.set()
        self._changed = asyncio.Event()
        return event

    def last_id(self) -> int:
        """The newest event's id (0 for an empty log): where a follower starts."""
        row = self._db.execute("select max(id) from events").fetchone()
        return int(row[0] or 0)

    def since(self, after: int = 0, limit: int = 100, subject: str | None = None) -> list[Event]:
        """Events with id > after, oldest first; ``after=-N`` means the last N."""
        where, args = "1=1", []
        if subject:
            where, args = "subject = ?", [subject]
        if after < 0:
            rows = list(self._db.table("events").rows_where(
                where, args, order_by="id desc", limit=min(-after, limit)))
            rows.reverse()
        else:
            rows = list(self._db.table("events").rows_where(
                f"{where} and id > ?", [*args, after], order_by="id", limit=limit))
        return [Event(r["id"], r["ts"], r["kind"], r["subject"] or "", r["message"],
                      json.loads(r["data"] or "{}")) for r in rows]

    async def wait(self, timeout_s: float) -> None:
        """Return when an event is appended, or after ``timeout_s`` (a heartbeat for followers)."""
        changed = self._changed
        try:
            async with asyncio.timeout(timeout_s):
                await changed.wait()
        except TimeoutError:
            pass
