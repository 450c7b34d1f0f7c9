"""Helpers for the network shell tests: a served listener or agent, a raw core client."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlxceld.net import Listener, MxclStream
from mlxceld.net.agent import AgentService
from mlxceld.wire import Channel, Connection, ConnectionRole, key_id

from helpers import keys

T = TypeVar("T")

SECRET = b"the net tests' cluster secret, 40 bytes."
OTHER_SECRET = b"a different cluster secret, 40 bytes...."
CLIENT_ID = "127.0.0.1:19100"
TEST_TIMEOUT_S = 20.0


@dataclass
class LyingKeyring:
    """Claims ``claimed``'s key id while holding ``actual``: a different secret, same key id."""

    claimed: bytes
    actual: bytes

    @property
    def primary(self) -> bytes:
        return self.actual

    @property
    def primary_id(self) -> bytes | None:
        return key_id(self.claimed)

    def get(self, kid: bytes) -> bytes | None:
        return self.actual if kid == key_id(self.claimed) else None


def run(coro: Coroutine[Any, Any, T]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            return await coro
    return asyncio.run(bounded())


@dataclass
class Refusals:
    """An ``on_refused`` callback that records (kind, peer) and wakes waiters."""

    seen: list[tuple[str, str]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, kind: str, peer: str) -> None:
        self.seen.append((kind, peer))
        self._changed.set()

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.seen]

    async def wait_for(self, kind: str, count: int = 1) -> None:
        while self.kinds().count(kind) < count:
            self._changed.clear()
            await self._changed.wait()


async def echo(stream: MxclStream) -> None:
    while True:
        await stream.send(await stream.recv())


@contextlib.asynccontextmanager
async def serving(handler: Callable[[MxclStream], Awaitable[None]] = echo,
                  **kwargs: Any) -> AsyncIterator[Listener]:
    kwargs.setdefault("keyring", keys.keyring(SECRET))
    kwargs.setdefault("channels", {1, 2, 3})
    listener = Listener("127.0.0.1", 0, identity_of_server="127.0.0.1:0", handler=handler,
                        **kwargs)
    await listener.start()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(listener.serve())
        await listener.wait_accepting()
        try:
            yield listener
        finally:
            await listener.aclose()


@contextlib.asynccontextmanager
async def accepting(run: Callable[[asyncio.Future[None]], Awaitable[None]],
                    aclose: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """``run(started)`` in a task, accepting (its ``started`` answered) until the block
    ends; then ``aclose()``, and the task awaited."""
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run(started))
    await started
    try:
        yield
    finally:
        await aclose()
        await task


@contextlib.asynccontextmanager
async def running(agent: AgentService) -> AsyncIterator[AgentService]:
    """``agent`` accepting (its ``started`` answered) until the block ends; then closed."""
    async with accepting(agent.run, agent.aclose):
        yield agent


@contextlib.asynccontextmanager
async def raw_client(port: int, *, keyring: Any = None, identity: str = CLIENT_ID,
                     tamper: Callable[[bytes], bytes] | None = None,
                     ) -> AsyncIterator[tuple[Connection, asyncio.StreamReader,
                                              asyncio.StreamWriter]]:
    """A socket driven by the core directly; ``tamper`` rewrites the ClientAuth.

    Yields once the handshake is done (or the server hung up: ``conn`` is then broken).
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        loop = asyncio.get_running_loop()
        conn = Connection(ConnectionRole.CLIENT, keyring=keyring or keys.keyring(SECRET),
                          random=os.urandom,
                          now=loop.time(), channel=Channel.TRANSPORT, identity=identity)
        writer.write(conn.data_to_send())
        sent_hello = True
        while not conn.established and not conn.closed:
            data = await reader.read(65536)
            try:
                conn.receive_data(data, loop.time())
            except Exception:
                break
            out = conn.data_to_send()
            if out and sent_hello and tamper is not None:
                out, sent_hello = tamper(out), False
            writer.write(out)
        yield conn, reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while chunk := await reader.read(65536):
        chunks.append(chunk)
    return b"".join(chunks)
