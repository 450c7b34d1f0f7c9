"""One outgoing stream to one peer: dialed when first needed, and again after it broke.

``stream()`` returns the open stream, or dials one (``connect`` as ``origin``: the
identity it claims and the IP it dials from; retried within ``budget_s``, else
``HandshakeFailed``). Dials are serialized, so callers that come while one is under
way share it. ``run()`` reads every stream dialed, each in a task of its own task
group: the stream answers pings on the way, anything else goes to ``on_message``,
and a stream the peer closed is noticed at once, so the next ``stream()`` dials
afresh. With ``silence_s``, each stream also has a heartbeat while it is read
(``liveness.watch``): a peer that answers nothing for that long (asleep, off the
network) has its stream ended, so the next ``stream()`` dials afresh instead of
writing into a socket nobody reads. The streams are read only while ``run`` runs.
``forget()`` drops the stream (a send on it failed: the next ``stream()`` dials);
``aclose`` closes it with a close frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from mlxceld.net.dialer import connect
from mlxceld.net.errors import ConnectionClosed
from mlxceld.net.liveness import watch
from mlxceld.net.stream import MxclStream
from mlxceld.wire import SecretStore
from mlxceld.wire.address import HostPort, format_address

log = logging.getLogger(__name__)


class Redialer:
    def __init__(self, target: tuple[str, int] | None, *, keyring: SecretStore,
                 origin: HostPort, channel: int, what: str, budget_s: float,
                 on_message: Callable[[bytes], None], silence_s: float | None = None) -> None:
        """``target``: the peer's listener (None: there is none, and ``stream`` must not be
        called); ``origin``: our own listener, whose identity we claim; ``what``: the peer
        in log lines ("next stage"); ``silence_s``: the heartbeat's bound (None: none)."""
        self.target = target
        self.what = what
        self._keyring = keyring
        self._origin = origin
        self._channel = channel
        self._budget_s = budget_s
        self._on_message = on_message
        self._silence_s = silence_s
        self._stream: MxclStream | None = None
        self._lock = asyncio.Lock()
        self._dialed: asyncio.Queue[MxclStream] = asyncio.Queue()  # for ``run`` to read

    async def stream(self) -> MxclStream:
        """The open stream to ``target``, dialed if there is none; ``HandshakeFailed``."""
        async with self._lock:
            if self._stream is not None and not self._stream.closed:
                return self._stream
            assert self.target is not None, f"there is no {self.what} to dial"
            host, port = self.target
            self._stream = await connect(
                host, port, keyring=self._keyring, identity=self._origin.claim(),
                channel=self._channel, budget_s=self._budget_s,
                local_addr=self._origin.local_addr())
            self._dialed.put_nowait(self._stream)
            log.info("connected to the %s at %s", self.what, format_address(host, port))
            return self._stream

    def forget(self) -> None:
        """Drop the stream (not closed here): the next ``stream()`` dials a new one."""
        self._stream = None

    async def run(self) -> None:
        """Read each stream dialed, in a task of its own, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            while True:
                tg.create_task(self._read(await self._dialed.get()))

    async def _read(self, stream: MxclStream) -> None:
        async with asyncio.TaskGroup() as tg:
            heartbeat = (tg.create_task(watch(stream, self._silence_s, f"the {self.what}"))
                         if self._silence_s is not None else None)
            with contextlib.suppress(ConnectionClosed):
                while True:
                    self._on_message(await stream.recv())
            if heartbeat is not None:
                heartbeat.cancel()

    async def aclose(self, reason: str = "") -> None:
        """Close the stream, if any, with a close frame carrying ``reason``."""
        if self._stream is not None:
            await self._stream.close(reason)
