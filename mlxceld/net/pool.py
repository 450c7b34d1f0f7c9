"""Reuse one authenticated stream per (peer, channel); dial when there is none.

A stream that ended (a close frame, an abort, a send or receive error, or our own
``close``) is dropped the next time ``get`` looks at it, and a fresh one is dialed.
Dials to one (peer, channel) are serialized, so concurrent ``get`` calls share one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict
from collections.abc import Callable

from mlxceld.net.dialer import connect
from mlxceld.net.errors import NetError
from mlxceld.net.stream import MxclStream
from mlxceld.wire import FrameLimits, SecretStore
from mlxceld.wire.frames import DEFAULT_LIMITS

log = logging.getLogger(__name__)

PoolKey = tuple[str, int, int]  # (host, port, channel)


class PoolClosed(NetError):
    """``get`` on a pool after ``aclose``."""


class ConnectionPool:
    def __init__(self, *, keyring: SecretStore, identity: str, suite: int = 1,
                 random: Callable[[int], bytes] = os.urandom, budget_s: float = 10.0,
                 local_addr: tuple[str, int] | None = None,
                 limits: FrameLimits = DEFAULT_LIMITS) -> None:
        self._keyring = keyring
        self._identity = identity
        self._suite = suite
        self._random = random
        self._budget_s = budget_s
        self._local_addr = local_addr
        self._limits = limits
        self._streams: dict[PoolKey, MxclStream] = {}
        self._locks: defaultdict[PoolKey, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._closed = False

    def __len__(self) -> int:
        return sum(1 for stream in self._streams.values() if not stream.closed)

    async def get(self, host: str, port: int, channel: int) -> MxclStream:
        """An open stream to ``host:port`` on ``channel``; raises ``HandshakeFailed``."""
        key = (host, port, int(channel))
        async with self._locks[key]:
            if self._closed:
                raise PoolClosed(f"the connection pool is closed; cannot reach {host}:{port}")
            stream = self._streams.get(key)
            if stream is not None and not stream.closed:
                return stream
            if stream is not None:
                log.info("dropping the ended stream to %s on channel %d", stream.peer, key[2])
                del self._streams[key]
                await stream.close()
            stream = await connect(host, port, keyring=self._keyring, identity=self._identity,
                                   channel=channel, suite=self._suite, random=self._random,
                                   budget_s=self._budget_s, local_addr=self._local_addr,
                                   limits=self._limits)
            if self._closed:  # aclose ran while we dialed
                await stream.close("shutting down")
                raise PoolClosed(f"the connection pool closed while dialing {host}:{port}")
            self._streams[key] = stream
            return stream

    async def aclose(self) -> None:
        """Close every stream with a close frame; later ``get`` calls fail."""
        self._closed = True
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.close("shutting down")

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
