"""HTTP/1.1 over the control socket: one connection per request, h11 for the bytes.

The control client needs four things of HTTP: send a request, read the status, read a
body whole, read a body as it comes (the NDJSON streams). asyncio's Unix streams and
h11's client state machine do all four; a general HTTP client (httpx pulls in httpcore,
anyio and its own h11 layer) cost mlxctl a tenth of a second of imports per command.

Failures are translated here, once, into our errors naming the socket: nothing there
or nothing listening is ``DaemonNotRunning``, a refused ``connect()`` is
``PermissionDenied``, a connection that ends
before the answer does is a ``ControlError``. Timeouts are the caller's
(``asyncio.timeout`` at the call site).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import AsyncGenerator
from pathlib import Path

import h11

from mlxceld import __version__
from mlxceld.errors import ControlError, DaemonNotRunning, PermissionDenied

READ_SIZE = 65536
START_HINT = ("start it with `mlxceld` (or `brew services start mlxceld`, "
              "`systemctl start mlxceld`), or point --socket / MLXCELD_SOCKET at a running one")
DENIED_HINT = "run mlxctl as the user that runs mlxceld, or as root"
_ABSENT = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR)
_DENIED = (errno.EACCES, errno.EPERM)


class Exchange:
    """One request and its response on a fresh connection to the socket at ``path``.

    ``await Exchange.open(...)`` connects, sends the request and reads the response's
    head (``status``); then ``read()`` or ``chunks()`` the body, and ``aclose()``.
    """

    def __init__(self, path: Path, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.path = path
        self.status = 0
        self._reader = reader
        self._writer = writer
        self._conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, path: Path, method: str, target: str,
                   body: bytes | None = None) -> Exchange:
        reader, writer = await _connect(path)
        exchange = cls(path, reader, writer)
        try:
            await exchange._send(method, target, body)
            await exchange._receive_head()
        except BaseException:
            await exchange.aclose()
            raise
        return exchange

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive, until the end of the message."""
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):  # already gone: closing is all we wanted
            await self._writer.wait_closed()

    async def _send(self, method: str, target: str, body: bytes | None) -> None:
        headers = [("Host", "mlxceld"), ("User-Agent", f"mlxctl/{__version__}"),
                   ("Accept", "application/json")]
        if body is not None:
            headers += [("Content-Type", "application/json"),
                        ("Content-Length", str(len(body)))]
        data = self._conn.send(h11.Request(method=method, target=target, headers=headers))
        if body:
            data = (data or b"") + (self._conn.send(h11.Data(data=body)) or b"")
        data = (data or b"") + (self._conn.send(h11.EndOfMessage()) or b"")
        try:
            self._writer.write(data)
            await self._writer.drain()
        except OSError as exc:
            raise _lost(self.path, exc) from exc

    async def _receive_head(self) -> None:
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Response):
                self.status = event.status_code
                return

    async def _next_event(self) -> h11.Event:
        """The next event that is not 'need more bytes' (a 1xx head is skipped too)."""
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise _lost(self.path, exc) from exc
            if event is h11.NEED_DATA:
                try:
                    data = await self._reader.read(READ_SIZE)
                except OSError as exc:
                    raise _lost(self.path, exc) from exc
                self._conn.receive_data(data)  # b"": the daemon closed its end
            elif event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                raise _lost(self.path, None)
            elif isinstance(event, h11.Event) and not isinstance(event,
                                                                 h11.InformationalResponse):
                return event


async def _connect(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        return await asyncio.open_unix_connection(os.fspath(path))
    except OSError as exc:
        if exc.errno in _ABSENT:
            raise DaemonNotRunning(f"mlxceld is not running (nothing listens on {path})",
                                   hint=START_HINT) from exc
        if exc.errno in _DENIED:
            raise PermissionDenied(f"permission denied on the control socket {path}",
                                   hint=DENIED_HINT) from exc
        raise ControlError(f"cannot talk to the daemon at {path}: "
                           f"{exc.strerror or exc}") from exc


def _lost(path: Path, exc: BaseException | None) -> ControlError:
    why = f" ({exc})" if exc is not None and str(exc) else ""
    return ControlError(f"the daemon at {path} closed the connection{why}",
                        hint="it may be stopping; check `mlxctl status` again")
