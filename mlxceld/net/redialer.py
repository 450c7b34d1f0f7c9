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

Handover (``hand_over``, when the keyring's primary changed: a secret rotation's
``use``): a stream made under another key than the primary is replaced without losing
a message. The new stream is dialed under the primary first (the old one is used
meanwhile); then, with senders held, the old one is finished (our close frame follows
all we sent on it) and its reader waits for the peer's close to come back, at most
``FINISH_S``: by then the peer has taken every message of the old stream, so none sent
on the new one overtakes it (a sequence's steps arrive in order). ``send`` retries once,
on the new stream, a message whose stream was handed over while it waited to write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Final

from mlxceld.net.dialer import connect
from mlxceld.net.errors import ConnectionClosed
from mlxceld.net.liveness import watch
from mlxceld.net.stream import MxclStream
from mlxceld.wire import SecretStore
from mlxceld.wire.address import HostPort, format_address

log = logging.getLogger(__name__)

FINISH_S: Final = 5.0  # a handed-over stream's close may take this long to come back
HANDED_OVER: Final = "handed over to a stream under the new primary key"


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
        self._read_done: dict[MxclStream, asyncio.Event] = {}  # set once ``_read`` ends
        self._handed: weakref.WeakSet[MxclStream] = weakref.WeakSet()  # finished by us

    async def stream(self) -> MxclStream:
        """The open stream to ``target``, dialed if there is none; ``HandshakeFailed``."""
        async with self._lock:
            if self._stream is not None and not self._stream.closed:
                return self._stream
            self._stream = await self._dial()
            self._read_later(self._stream)
            return self._stream

    async def _dial(self) -> MxclStream:
        assert self.target is not None, f"there is no {self.what} to dial"
        host, port = self.target
        stream = await connect(host, port, keyring=self._keyring,
                               identity=self._origin.claim(), channel=self._channel,
                               budget_s=self._budget_s, local_addr=self._origin.local_addr())
        log.info("connected to the %s at %s (key %s)", self.what, format_address(host, port),
                 stream.key_id.hex())
        return stream

    def _read_later(self, stream: MxclStream) -> None:
        self._read_done[stream] = asyncio.Event()
        self._dialed.put_nowait(stream)

    async def send(self, payload: bytes) -> None:
        """Send ``payload`` on the stream, dialed if there is none; a message whose stream
        was handed over while it waited is sent once more, on the new stream (nothing of it
        went out on the old one). ``HandshakeFailed``, ``ConnectionClosed``."""
        stream = await self.stream()
        try:
            await stream.send(payload)
        except ConnectionClosed:
            if stream not in self._handed:
                raise
            await (await self.stream()).send(payload)

    @property
    def stale(self) -> bool:
        """The open stream was made under another key than the keyring's primary."""
        s = self._stream
        return s is not None and not s.closed and s.key_id != self._keyring.primary_id

    async def hand_over(self) -> bool:
        """Replace a stale stream (see the module doc) with one under the primary; False
        when there was nothing to replace. ``HandshakeFailed`` when the new one cannot be
        dialed: the old one stays in use (until its key is removed)."""
        if not self.stale:
            return False
        new = await self._dial()
        async with self._lock:
            old = self._stream
            if old is not None and not old.closed and old.key_id == new.key_id:
                await new.close("not needed")  # replaced meanwhile, under the primary
                return False
            if old is not None and not old.closed:
                self._handed.add(old)
                old.finish(HANDED_OVER)
                done = self._read_done.get(old)
                if done is not None:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(FINISH_S):
                            await done.wait()
                if not old.closed:
                    log.warning("the %s did not answer the handover's close within %g s; "
                                "dropping the old stream", self.what, FINISH_S)
                    await old.abort()
            self._stream = new
            self._read_later(new)
        log.info("handed the %s over to a stream under key %s", self.what, new.key_id.hex())
        return True

    @property
    def rtt_s(self) -> float | None:
        """The round trip of the open stream's latest heartbeat ping answered (None: no
        stream open, or no ping answered on it yet)."""
        s = self._stream
        return s.rtt_s if s is not None and not s.closed else None

    def forget(self) -> None:
        """Drop the stream (not closed here): the next ``stream()`` dials a new one."""
        self._stream = None

    async def run(self) -> None:
        """Read each stream dialed, in a task of its own, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            while True:
                tg.create_task(self._read(await self._dialed.get()))

    async def _read(self, stream: MxclStream) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                heartbeat = (tg.create_task(watch(stream, self._silence_s, f"the {self.what}"))
                             if self._silence_s is not None else None)
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        self._on_message(await stream.recv())
                if heartbeat is not None:
                    heartbeat.cancel()
        finally:
            done = self._read_done.pop(stream, None)
            if done is not None:
                done.set()

    async def aclose(self, reason: str = "") -> None:
        """Close the stream, if any, with a close frame carrying ``reason``."""
        if self._stream is not None:
            await self._stream.close(reason)
