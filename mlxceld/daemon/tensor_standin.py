"""The OpenAI port's stand-in while a tensor-parallel group across hosts is down.

Rank 0's router worker runs only while its group is formed (``daemon/tensor_peers.py``):
a rank host lost ends it. Meanwhile nothing of ours would listen on the OpenAI port,
and a client (or a load balancer's ``GET /ready``) could only read "connection
refused". So while the group is down, rank 0's daemon serves that port itself: every
request, ``/ready`` included, is answered ``503`` with ``Retry-After`` and an
OpenAI-shaped error whose message says why (which rank, on which host, and that the
group forms again when the host is back). The router binds the same port beside it
(both with SO_REUSEPORT) and the stand-in lets it go once the router runs, so a client
is never refused while the group forms again and its router loads; meanwhile a
connection is answered 503 here or waits in the router's queue until it serves.

It is the control socket's server (``control/server.SocketServer``: uvicorn under the
guard), with the OpenAI port's kind of bounds: at most ``MAX_CONNECTIONS``, a request's
head within ``HEAD_S``, its body read (so that a client is answered, not reset, whatever
it sent) within ``HEAD_S`` too, a reader that takes nothing dropped after ``HEAD_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable
from typing import Final

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from mlxceld.control.server import SocketServer
from mlxceld.guard.connections import ConnectionLimits, Refusal

log = logging.getLogger(__name__)

MAX_CONNECTIONS: Final = 64
HEAD_S: Final = 5.0
RETRY_AFTER_S: Final = 5
CODE: Final = "tensor_group_down"
MAX_BODY: Final = 4 << 20  # what it reads of a body before answering (the API's own bound)


def body(why: str) -> dict[str, object]:
    """The answer's JSON: ``/ready``'s shape and the API's error, both saying ``why``."""
    return {"status": "degraded", "reason": why,
            "error": {"message": why, "type": "service_unavailable", "param": None,
                      "code": CODE}}


def _refusal(refusal: Refusal) -> bytes:
    """The guard's own refusals (over the cap, a slow head) in the same shape."""
    return json.dumps(body(refusal.message)).encode()


class StandIn:
    """Serves ``host:port`` while opened; ``why()`` is read for each answer."""

    def __init__(self, host: str, port: int, why: Callable[[], str]) -> None:
        self._host, self._port = host, port
        self._why = why
        self._task: asyncio.Task[None] | None = None
        self._server: SocketServer | None = None

    @property
    def listening(self) -> bool:
        return self._task is not None

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        read = 0
        async for chunk in Request(scope, receive).stream():  # read, so it is answered
            read += len(chunk)
            if read > MAX_BODY:
                break
        await JSONResponse(body(self._why()), 503, {"retry-after": str(RETRY_AFTER_S),
                                                    "connection": "close"})(scope, receive,
                                                                            send)

    async def open(self) -> None:
        """Listen (once); a port someone else holds is logged and left alone."""
        if self._task is not None:
            return
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            # Shared (SO_REUSEPORT) with the router, which binds it while this still
            # answers: it is let go once the router runs (``TensorPeers``), so no client
            # is refused in between. Only sockets of this user can join it (Linux).
            sock = socket.create_server((self._host, self._port), family=family,
                                        reuse_port=True)
        except OSError as exc:
            log.warning("tensor group: cannot answer on %s:%d while it is down: %s",
                        self._host, self._port, exc.strerror)
            return
        sock.setblocking(False)
        limits = ConnectionLimits(MAX_CONNECTIONS, HEAD_S, HEAD_S, write_stall_s=HEAD_S)
        server = SocketServer(self._app, sock, graceful_timeout_s=1.0, limits=limits,
                              render=_refusal, what="the OpenAI port (tensor group down)")
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._server = server
        self._task = asyncio.create_task(server.serve(started))
        with contextlib.suppress(asyncio.CancelledError):
            await started

    async def close(self) -> None:
        """Stop listening (the router binds the port next), within ``HEAD_S``."""
        task, server = self._task, self._server
        self._task = self._server = None
        if task is None or server is None:
            return
        server.request_shutdown()
        try:
            async with asyncio.timeout(HEAD_S):
                await task
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
