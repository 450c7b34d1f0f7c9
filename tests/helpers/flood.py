"""Silent sockets held open on a port from several loopback sources (127.0.0.x on Linux).

``silent_flood`` keeps ``per_source`` sockets from each source connected and silent:
a socket the server closes is opened again after ``pause_s``, so the server's pending
pool stays under pressure for as long as the block runs. Every socket is closed when
the block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

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


async def _hold(host: str, port: int, source: str, flood: Flood, pause_s: float) -> None:
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
            await reader.read(1)  # nothing comes to a silent socket: b"" once it is closed
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
    flood = Flood(len(from_sources) * per_source)
    tasks = [asyncio.create_task(_hold(host, port, source, flood, pause_s))
             for source in from_sources for _ in range(per_source)]
    try:
        yield flood
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
