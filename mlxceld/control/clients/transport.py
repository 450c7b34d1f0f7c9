"""The asyncio shell of ``exchange``: one request and its answer on a fresh connection.

Timeouts are the caller's (``asyncio.timeout`` at the call site).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator
from pathlib import Path

import h11

from mlxceld.control.clients.exchange import READ_SIZE, Event, Exchange, connect_error, lost


class Connection:
    """``await Connection.open(...)`` connects, sends the request and reads the answer's
    head (``status``); then ``read()`` or ``chunks()`` the body, and ``aclose()``."""

    def __init__(self, exchange: Exchange, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.status = 0
        self._exchange = exchange
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, path: Path, method: str, target: str,
                   body: bytes | None = None) -> Connection:
        exchange = Exchange(path)
        try:
            reader, writer = await asyncio.open_unix_connection(os.fspath(path))
        except OSError as exc:
            raise connect_error(path, exc) from exc
        conn = cls(exchange, reader, writer)
        try:
            try:
                writer.write(exchange.request(method, target, body))
                await writer.drain()
            except OSError as exc:
                raise lost(path, exc) from exc
            while not isinstance(event := await conn._next_event(), h11.Response):
                pass
            conn.status = event.status_code
        except BaseException:
            await conn.aclose()
            raise
        return conn

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive, until the end of the answer."""
        while not isinstance(event := await self._next_event(), h11.EndOfMessage):
            if isinstance(event, h11.Data):
                yield bytes(event.data)

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):  # already gone: closing is all we wanted
            await self._writer.wait_closed()

    async def _next_event(self) -> Event:
        while (event := self._exchange.next_event()) is None:
            try:
                data = await self._reader.read(READ_SIZE)
            except OSError as exc:
                raise lost(self._exchange.path, exc) from exc
            self._exchange.receive(data)
        return event
