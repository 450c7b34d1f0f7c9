"""The control API's streams (``follow=1``): newline-delimited JSON, one object a line.

An empty line is a heartbeat, sent after ``HEARTBEAT_S`` seconds without news,
so that a client can put a deadline on every read. A stream ends when the
daemon stops.

A follower holds no queue of its own: each stream is a position in its source (the
``events`` table, a log file) and reads the next batch (at most ``limit`` events, or
what a log grew by) only once the previous one was taken. A reader that does not read
is waited for: uvicorn stops our writes while the socket's buffers are full (its flow
control), so what a slow or stopped reader costs the daemon is those buffers and one
batch, however far behind it falls; nothing is dropped for it, and it catches up from
the table when it reads again (the table keeps ``KEEP_EVENTS``, trimmed only at a
start, when every stream has ended). A reader that takes nothing at all for
``server.FOLLOWER_STALL_S`` (30 s) while the buffers are full is disconnected (the
control socket's ``write_stall_s``, ``connections.py``; logged once per burst), so that
stopped followers never hold the socket's connections: its client reports the stream
ended, and `mlxctl events -f` started again catches up from the table. A reader that
goes away ends its stream at the next write or heartbeat.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Final

from mlxceld.state import EventLog
from mlxceld.supervisor import logfiles
from mlxceld.types import JSON

NDJSON: Final = "application/x-ndjson"
HEARTBEAT_S: Final = 15.0
LOG_POLL_S: Final = 0.25


def line(obj: JSON) -> bytes:
    return json.dumps(obj).encode() + b"\n"


async def log_lines(stopping: Callable[[], bool], path: Path, lines: int,
                    follow: bool) -> AsyncIterator[bytes]:
    """The last ``lines`` lines of a worker's log, then (``follow``) what it appends, until
    the daemon is ``stopping()``."""
    text, offset = logfiles.tail(path, lines)
    if text:
        yield line({"data": text})
    idle = 0.0
    while follow and not stopping():
        await asyncio.sleep(LOG_POLL_S)
        data, offset = logfiles.read_from(path, offset)
        if data:
            idle = 0.0
            yield line({"data": data.decode("utf-8", "replace")})
        else:
            idle += LOG_POLL_S
            if idle >= HEARTBEAT_S:
                idle = 0.0
                yield b"\n"


async def event_lines(events: EventLog, stopping: Callable[[], bool], after: int, limit: int,
                      subject: str | None) -> AsyncIterator[bytes]:
    """Events after ``after`` (of ``subject``), in batches of ``limit``, as they come, until
    the daemon is ``stopping()``; ``after=-N``: the last N first (all N, whatever
    ``limit``), then every later one."""
    if after < 0:  # a position, once: what is appended later is never "the last N"
        past = events.since(after, -after, subject)
        after = past[0].id - 1 if past else events.last_id()
    while not stopping():
        batch = events.since(after, limit, subject)
        for event in batch:
            after = event.id
            yield line(event.to_json())
        if not batch:
            await events.wait(HEARTBEAT_S)
            if not events.since(after, 1, subject):
                yield b"\n"
