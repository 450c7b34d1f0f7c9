"""Sockets held open on a port from several loopback sources (127.0.0.x on Linux).

``silent_flood`` keeps ``per_source`` sockets from each source connected and silent;
``keyed_hello_flood`` keeps them connected, each having sent a complete ClientHello
with the cluster's key id (public: it is in every hello) and then nothing more, so
that each stalls the server's handshake after its ServerHello. Either way a socket
the server closes is opened again after ``pause_s``, so the server's pending pool
stays under pressure for as long as the block runs. Every socket is closed when the
block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from mlxceld.wire.hello import VERSION, ClientHello

PAUSE_S = 0.1  # between a socket closed by the server and the next one from that holder


def sources(n: int, first: int = 2) -> list[str]:
    """``n`` loopback source addresses, 127.0.0.{first}..."""
    return [f"127.0.0.{i}" for i in range(first, first + n)]


@dataclass
class Flood:
    sockets: int  # held at once, at most
    opened: int = 0
    closed_by_server: int = 0
    _first_opened: int = 0
    _all_open: asyncio.Event = field(default_factory=asyncio.Event)

    async def all_opened(self) -> None:
        """Return once every holder has had its first socket accepted by the kernel."""
        await self._all_open.wait()

    def _count_open(self, first: bool) -> None:
        self.opened += 1
        self._first_opened += first
        if self._first_opened >= self.sockets:
            self._all_open.set()


def stalled_hello(key_id: bytes, channel: int) -> Callable[[str], bytes]:
    """A complete ClientHello from ``source`` (its identity ``source:19100``, the IP the
    server checks) carrying ``key_id``, as one who knows the key id but not the secret
    writes it: a fresh nonce and a real X25519 share each time."""
    def hello(source: str) -> bytes:
        share = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw,
                                                                      PublicFormat.Raw)
        return ClientHello(VERSION, 1, channel, key_id, os.urandom(32), share,
                           f"{source}:19100").encode()
    return hello


async def _hold(host: str, port: int, source: str, flood: Flood, pause_s: float,
                first_bytes: Callable[[str], bytes] | None = None) -> None:
    first = True
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(pause_s)
            continue
        flood._count_open(first)
        first = False
        try:
            if first_bytes is not None:
                writer.write(first_bytes(source))
            # Nothing comes to a silent socket, a ServerHello to a hello: b"" once closed.
            while await reader.read(4096):
                pass
            flood.closed_by_server += 1
        except OSError:
            flood.closed_by_server += 1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await asyncio.sleep(pause_s)


@contextlib.asynccontextmanager
async def silent_flood(host: str, port: int, from_sources: list[str], per_source: int = 8,
                       pause_s: float = PAUSE_S) -> AsyncIterator[Flood]:
    """``per_source`` silent sockets to ``host:port`` from each of ``from_sources``, kept
    open (reopened when closed) until the block ends; then every one is closed."""
    async with _flood(host, port, from_sources, per_source, pause_s, None) as flood:
        yield flood


@contextlib.asynccontextmanager
async def keyed_hello_flood(host: str, port: int, from_sources: list[str], key_id: bytes,
                            channel: int, per_source: int = 8,
                            pause_s: float = PAUSE_S) -> AsyncIterator[Flood]:
    """``per_source`` sockets to ``host:port`` from each of ``from_sources``, each sending
    a complete ClientHello with ``key_id`` on ``channel`` and then stalling, kept open
    (reopened when closed) until the block ends; then every one is closed."""
    async with _flood(host, port, from_sources, per_source, pause_s,
                      stalled_hello(key_id, channel)) as flood:
        yield flood


@contextlib.asynccontextmanager
async def _flood(host: str, port: int, from_sources: list[str], per_source: int,
                 pause_s: float, first_bytes: Callable[[str], bytes] | None,
                 ) -> AsyncIterator[Flood]:
    flood = Flood(len(from_sources) * per_source)
    tasks = [asyncio.create_task(_hold(host, port, source, flood, pause_s, first_bytes))
             for source in from_sources for _ in range(per_source)]
    try:
        yield flood
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
