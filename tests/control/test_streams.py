"""The event stream behind ``mlxctl events -f``, over a real SQLite event log: where it
starts, and that it loses nothing however events arrive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import sqlite_utils

from mlxceld.control.streams import event_lines
from mlxceld.state import EventLog


class View:
    """What a stream reads: the event log, and whether the daemon stops."""

    def __init__(self, events: EventLog) -> None:
        self.events = events
        self.stopping = False


async def take(lines: AsyncIterator[bytes], n: int) -> list[int]:
    import json

    ids = []
    while len(ids) < n:
        async with asyncio.timeout(5):
            line = await anext(lines)
        if line.strip():
            ids.append(json.loads(line)["id"])
    return ids


def test_the_last_n_come_first_whatever_the_batch_limit(db: sqlite_utils.Database) -> None:
    async def go() -> list[int]:
        log = EventLog(db)
        for i in range(250):
            log.append("test.made", "t", f"event {i}")
        view = View(log)
        lines = event_lines(view.events, lambda: view.stopping, -150, 100, None)
        got = await take(lines, 150)
        await lines.aclose()
        return got

    assert asyncio.run(go()) == list(range(101, 251))


def test_a_burst_after_an_empty_start_is_streamed_whole(db: sqlite_utils.Database) -> None:
    """Before: a stream that found nothing kept asking for "the last 20", and a burst of
    more than 20 between two looks lost all but its last 20."""

    async def go() -> list[int]:
        log = EventLog(db)
        view = View(log)
        lines = event_lines(view.events, lambda: view.stopping, -20, 100, "alpha")
        first = asyncio.ensure_future(take(lines, 60))
        await asyncio.sleep(0.05)  # the stream is waiting for news
        for i in range(60):
            log.append("test.made", "alpha", f"event {i}")
        got = await first
        await lines.aclose()
        return got

    assert asyncio.run(go()) == list(range(1, 61))
