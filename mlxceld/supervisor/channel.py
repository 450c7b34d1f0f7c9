"""The daemon's side of a worker's control channel: one JSON line out, one back."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from mlxceld.errors import ChannelError
from mlxceld.supervisor.ops import WorkerRequest
from mlxceld.types import JSON

MAX_REPLY = 1 << 20
DEFAULT_TIMEOUT_S = 2.0


async def call(path: Path, request: WorkerRequest, *,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> JSON:
    """Send ``request`` (``ops.py``) to the worker listening on ``path``; ChannelError on any
    failure, naming the op, never the arguments (a keyring update carries secrets).

    The whole exchange (connect, write, read) has one deadline of ``timeout_s``.
    """
    op = request.OP
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(str(path), limit=MAX_REPLY)
            writer.write(json.dumps(request.to_wire()).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        reply: JSON = json.loads(line)
    except TimeoutError as exc:
        raise ChannelError(f"worker channel {path} did not answer {op!r} within {timeout_s} s",
                           hint="the worker may be stuck; see mlxctl logs") from exc
    except (OSError, ValueError) as exc:
        raise ChannelError(f"worker channel {path} failed on {op!r}: {exc}",
                           hint="the worker may have exited; see mlxctl logs") from exc
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise ChannelError(f"worker channel {path} refused {op!r}: {reply!r}")
    return reply
