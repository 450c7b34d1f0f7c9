"""The control client without asyncio, for mlxctl's read-only commands.

``status``, ``workers`` and ``logs`` are what people run most, and asyncio's import
was a third of their time. Same requests, answers and errors as ``ControlClient``
(both drive ``exchange``); a plain socket with a deadline on every step.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import h11

from mlxceld.control.clients.exchange import (
    READ_SIZE,
    REQUEST_TIMEOUT_S,
    STREAM_READ_TIMEOUT_S,
    Event,
    Exchange,
    Lines,
    answer_error,
    connect_error,
    decode,
    lost,
    segment,
    target,
    timed_out,
)
from mlxceld.types import JSON


class BlockingClient:
    def __init__(self, socket_path: Path, timeout: float | None = None) -> None:
        """``timeout``: the deadline of each request's answer, ``REQUEST_TIMEOUT_S`` if
        None (``mlxctl status --watch`` asks sooner, to show a daemon that does not
        answer)."""
        self.socket_path = socket_path
        self.timeout = REQUEST_TIMEOUT_S if timeout is None else timeout

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Nothing stays open between requests."""

    def status(self) -> JSON:
        return self._get("/v1/status")

    def workers(self) -> JSON:
        return self._get("/v1/workers")

    def logs(self, worker: str, lines: int = 50, follow: bool = False) -> Iterator[JSON]:
        where = target(f"/v1/workers/{segment(worker)}/logs",
                       {"lines": lines, "follow": int(follow)})
        with _Connection(self.socket_path, where, REQUEST_TIMEOUT_S) as conn:
            if conn.status >= 400:
                raise answer_error(conn.status, conn.read())
            items = Lines()
            for chunk in conn.chunks(STREAM_READ_TIMEOUT_S):
                yield from items.feed(chunk)
            yield from items.feed(b"")

    def _get(self, path: str) -> JSON:
        with _Connection(self.socket_path, path, self.timeout) as conn:
            return decode(self.socket_path, path, conn.status, conn.read())


class _Connection:
    """A GET on a fresh connection; its head read within ``timeout``, as is ``read()``."""

    def __init__(self, path: Path, where: str, timeout: float) -> None:
        self._exchange = Exchange(path)
        self._deadline: float | None = time.monotonic() + timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            try:
                self._sock.connect(os.fspath(path))
            except TimeoutError as exc:
                raise timed_out(self._exchange.path) from exc
            except OSError as exc:
                raise connect_error(path, exc) from exc
            self._send(self._exchange.request("GET", where))
            while not isinstance(event := self._next_event(), h11.Response):
                pass
            self.status = event.status_code
        except BaseException:
            self._sock.close()
            raise

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._sock.close()

    def read(self) -> bytes:
        """The whole body, by the deadline the connection was opened with."""
        return b"".join(self.chunks(None))

    def chunks(self, each_s: float | None) -> Iterator[bytes]:
        """The body's bytes as they arrive; each read within ``each_s`` (None: by the
        connection's deadline)."""
        if each_s is not None:
            self._deadline = None
            self._sock.settimeout(each_s)
        while not isinstance(event := self._next_event(), h11.EndOfMessage):
            if isinstance(event, h11.Data):
                yield bytes(event.data)

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except TimeoutError as exc:
            raise timed_out(self._exchange.path) from exc
        except OSError as exc:
            raise lost(self._exchange.path, exc) from exc

    def _next_event(self) -> Event:
        while (event := self._exchange.next_event()) is None:
            if self._deadline is not None:
                self._sock.settimeout(max(self._deadline - time.monotonic(), 0.001))
            try:
                data = self._sock.recv(READ_SIZE)
            except TimeoutError as exc:
                raise timed_out(self._exchange.path) from exc
            except OSError as exc:
                raise lost(self._exchange.path, exc) from exc
            self._exchange.receive(data)
        return event
