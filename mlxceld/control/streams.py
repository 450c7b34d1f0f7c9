"""The control API's streams (``follow=1``): newline-delimited JSON, one object a line.

An empty line is a heartbeat, sent after ``HEARTBEAT_S`` seconds without news,
so that a client can put a deadline on every read. A stream ends when the
daemon stops.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

from mlxceld.control.view import DaemonView
from mlxceld.supervisor import logfiles
from mlxceld.types import JSON

NDJSON: Final = "application/x-ndjson"
HEARTBEAT_S: Final = 15.0
LOG_POLL_S: Final = 0.25


def line(obj: JSON) -> bytes:
    return json.dumps(obj).encode() + b"\n"


async def log_lines(daemon: DaemonView, path: Path, lines: int,
                    follow: bool) -> AsyncIterator[bytes]:
    """The last ``lines`` lines of a worker's log, then (``follow``) what it appends."""
    text, offset = logfiles.tail(path, lines)
    if text:
        yield line({"data": text})
    idle = 0.0
    while follow and not daemon.stopping:
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


async def event_lines(daemon: DaemonView, after: int, limit: int,
                      subject: str | None) -> AsyncIterator[bytes]:
    """Events after ``after`` (of ``subject``), in batches of ``limit``, as they come."""
    while not daemon.stopping:
        batch = daemon.events.since(after, limit, subject)
        for event in batch:
            after = event.id
            yield line(event.to_json())
        if not batch:
            await daemon.events.wait(HEARTBEAT_S)
            if not daemon.events.since(after, 1, subject):
                yield b"\n"
