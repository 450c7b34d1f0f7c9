"""The OpenAI port's stand-in while a tensor-parallel group across hosts is down.

Rank 0's router worker runs only while its group is formed (``daemon/tensor_peers.py``):
a rank host lost ends it. Meanwhile nothing of ours would listen on the OpenAI port,
and a client (or a load balancer's ``GET /ready``) could only read "connection
refused". So while the group is down, rank 0's daemon listens on that port itself and
answers every request at once with ``503`` (``Retry-After``), an OpenAI-shaped error
whose message says why: which rank, on which host, and that the group forms again when
the host is back. It closes its socket before the router starts, so the router finds
the port free.

Bounds: at most ``MAX_CONNECTIONS`` at once (others are closed at once); a request's
head within ``HEAD_S`` and ``MAX_HEAD`` bytes (its body is not read: the answer closes
the connection); the answer's write within ``HEAD_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Final

log = logging.getLogger(__name__)

MAX_CONNECTIONS: Final = 64
HEAD_S: Final = 5.0
MAX_HEAD: Final = 16 * 1024
RETRY_AFTER_S: Final = 5
CODE: Final = "tensor_group_down"


def answer(why: str) -> bytes:
    """The whole HTTP/1.1 answer: 503, JSON, ``Retry-After``, the connection closed."""
    body = json.dumps({"status": "degraded", "reason": why,  # /ready's shape, and the API's
                       "error": {"message": why, "type": "service_unavailable",
                                 "param": None, "code": CODE}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class StandIn:
    """Listens on ``host:port`` while opened; ``why()`` is read for each answer."""

    def __init__(self, host: str, port: int, why: Callable[[], str]) -> None:
        self._host, self._port = host, port
        self._why = why
        self._server: asyncio.Server | None = None
        self._open = 0

    @property
    def listening(self) -> bool:
        return self._server is not None

    async def open(self) -> None:
        """Listen (once); a port someone else holds is logged and left alone."""
        if self._server is not None:
            return
        try:
            self._server = await asyncio.start_server(self._serve, self._host, self._port,
                                                      reuse_address=True, limit=MAX_HEAD)
        except OSError as exc:
            log.warning("tensor group: cannot answer on %s:%d while it is down: %s",
                        self._host, self._port, exc.strerror)

    async def close(self) -> None:
        """Stop listening at once (the router binds the port next)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), HEAD_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open <= MAX_CONNECTIONS:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(HEAD_S):
                        await reader.readuntil(b"\r\n\r\n")
                        writer.write(answer(self._why()))
                        await writer.drain()
        finally:
            self._open -= 1
            writer.close()
