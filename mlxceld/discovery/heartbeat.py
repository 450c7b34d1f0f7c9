"""Heartbeats: the asyncio shell of the failure detector (``detector.py``).

Which peers: whatever ``peers()`` names (the member passes discovery's candidates and
the peers of its active plan), looked at every ping interval; our own agent address
is never one. Each peer has a task of its own, so that a silent peer (a stopped
process, a host asleep: the socket stays open, nothing answers) stalls nobody else:

1. Dial the peer's agent listener on MXCL channel 3 (``connect_as``, our identity
   our agent address) within ``peer_dead_after_s`` (the dialer's retries included); a
   failed dial is reported to the detector and tried again.
2. On that one stream, every ``peer_ping_interval_s``: send ``{"t": "ping", "id": n}``
   and wait for ``{"t": "pong", "id": n}`` (the peer's net shell answers it), the send
   and the wait together within ``peer_suspect_after_s`` (a send blocked on a full
   socket buffer counts). A pong is an answer; a time-out, a closed stream or a wrong
   answer is a failure, the stream is dropped (no close frame: the peer may not read
   it) and dialled again at once. The stream is read all along, between pings too:
   the peer's agent listener pings back a dialer that sends nothing for a while
   (``net/agent.py``), and our net shell answers it on the way.

The detector decides the state from the answers and the clock. Each transition is
written to the ``liveness`` table (state, since, reason, the last answer), appended
to the event log as ``peer.alive``, ``peer.suspect`` or ``peer.dead`` and logged once.
A peer no longer named by ``peers()`` is forgotten (its task ended, its row deleted).
At start the table's rows are taken over: a peer dead before the restart stays dead,
since when it was, until it answers (``Detector.track``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Final

from mlxceld.config.liveness import LivenessConfig
from mlxceld.discovery.detector import Detector, Transitioned
from mlxceld.discovery.inventory import AGENT_CHANNEL
from mlxceld.net import ConnectionClosed, HandshakeFailed, MxclStream, connect_as
from mlxceld.state.events import EventLog
from mlxceld.state.liveness import LivenessRow, LivenessTable
from mlxceld.tasks import scoped_group
from mlxceld.types import JSON
from mlxceld.wire import EnvelopeError, SecretStore, encode_envelope, parse_envelope
from mlxceld.wire.envelope import MessageSpec
from mlxceld.wire.messages import Error, Ping, Pong

log = logging.getLogger(__name__)

_PONG: Final = {Pong.T: MessageSpec(), Error.T: MessageSpec()}


class Heartbeats:
    def __init__(self, thresholds: LivenessConfig, keyring: SecretStore, identity: str, *,
                 peers: Callable[[], Iterable[str]], store: LivenessTable | None = None,
                 events: EventLog | None = None,
                 node_of: Callable[[str], str | None] = lambda _: None) -> None:
        self._t = thresholds
        self._keyring = keyring
        self._identity = identity  # our agent listener: who we say we are, never a peer
        self._peers = peers
        self._store = store
        self._events = events
        self._node_of = node_of
        self._detector = Detector(thresholds)
        self._rows: dict[str, LivenessRow] = {r.address: r for r in store.all()} if store else {}
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()

    # -- what `mlxctl cluster nodes` and `mlxctl status` show ------------------------------

    def row(self, address: str) -> LivenessRow | None:
        return self._rows.get(address)

    def snapshot(self) -> list[JSON]:
        return [self._rows[a].to_json() for a in sorted(self._rows)]

    def describe(self) -> JSON:
        t = self._t
        return {"ping_interval_s": t.ping_interval_s, "suspect_after_s": t.suspect_after_s,
                "dead_after_s": t.dead_after_s}

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    async def run(self) -> None:
        """Until ``close``: keep one heartbeat task per peer, and the detector's timer."""
        loop = asyncio.get_running_loop()
        beats: dict[str, asyncio.Task[None]] = {}
        try:
            async with asyncio.TaskGroup() as tg:
                while not self._stop.is_set():
                    try:
                        self._sync(tg, beats, loop.time())
                        self._apply(self._detector.handle_timer(loop.time()))
                    except Exception:  # a bug, a full disk: logged; never stops the daemon
                        log.exception("failure detector: a round failed; the next one follows")
                    wait = self._t.ping_interval_s  # the next look at peers()
                    deadline = self._detector.next_deadline()
                    if deadline is not None:
                        wait = min(wait, deadline - loop.time())
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(wait, 0.0)):
                            await self._wake.wait()
                    self._wake.clear()
                for task in beats.values():
                    task.cancel()
        finally:
            log.debug("heartbeats stopped")

    def _sync(self, tg: asyncio.TaskGroup, beats: dict[str, asyncio.Task[None]],
              now: float) -> None:
        wanted = {a for a in self._peers() if a != self._identity}
        for address in [a for a in beats if a not in wanted]:
            beats.pop(address).cancel()
        for address in [a for a in self._rows if a not in wanted]:
            self._detector.forget(address)
            del self._rows[address]
            if self._store is not None:
                self._store.delete(address)
            log.info("peer %s is no longer watched (no longer a candidate or a plan's peer)",
                     address)
        for address in sorted(wanted - beats.keys()):
            row = self._rows.get(address)
            self._detector.track(address, now, row.state if row else "unknown")
            if row is None:
                self._put(LivenessRow(address, "unknown", time.time(), "not answered yet",
                                      time.time(), node_id=self._node_of(address)))
            beats[address] = tg.create_task(self._beat_guarded(address))

    # -- answers and transitions --------------------------------------------------------

    def _answered(self, address: str) -> None:
        now = time.time()
        row = self._rows.get(address)
        if row is not None:  # in memory only: a write per pong would be a write a second
            self._rows[address] = replace(row, last_answer=now)
        self._apply(self._detector.answered(address, asyncio.get_running_loop().time()))

    def _failed(self, address: str, error: str) -> None:
        log.debug("heartbeat of %s: %s", address, error)
        self._detector.failed(address, error)

    def _apply(self, transitions: list[Transitioned]) -> None:
        loop_now, wall_now = asyncio.get_running_loop().time(), time.time()
        for t in transitions:
            old = self._rows.get(t.address)
            node = self._node_of(t.address) or (old.node_id if old else None)
            since = wall_now - max(loop_now - t.at, 0.0)
            self._put(LivenessRow(t.address, t.new, since, t.reason, wall_now, node_id=node,
                                  last_answer=old.last_answer if old else None))
            name = f"{node} ({t.address})" if node else t.address
            message = f"peer {name} is {t.new}: {t.reason}"
            (log.info if t.new == "alive" else log.warning)("%s (was %s)", message, t.old)
            if self._events is not None:
                self._events.append(f"peer.{t.new}", node or t.address, message,
                                    address=t.address, node_id=node, old=t.old, new=t.new,
                                    reason=t.reason, since=since)

    def _put(self, row: LivenessRow) -> None:
        self._rows[row.address] = row
        if self._store is not None:
            self._store.put(row)

    # -- one peer -------------------------------------------------------------------------

    async def _beat_guarded(self, address: str) -> None:
        """``_beat`` again and again, at most once per ping interval (a peer that closes
        each stream at once is not dialled in a tight loop)."""
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                await self._beat(address)
            except Exception as exc:  # a bug must not end the others' heartbeats
                log.exception("heartbeat of %s failed", address)
                self._failed(address, f"internal: {type(exc).__name__}")
            await asyncio.sleep(max(began + self._t.ping_interval_s - loop.time(), 0.0))

    async def _beat(self, address: str) -> None:
        """Dial ``address`` and ping it until the stream fails; then return (dial again)."""
        t = self._t
        try:
            stream = await connect_as(self._identity, address, keyring=self._keyring,
                                      channel=AGENT_CHANNEL, budget_s=t.dead_after_s)
        except HandshakeFailed as exc:
            self._failed(address, f"dial: {exc.kind}: {exc.message}")
            return
        loop = asyncio.get_running_loop()
        pongs = _Pongs()
        try:
            # The reader hands the stream's end to ``pongs``; it ends with the pings, and
            # whatever ends them comes out of the group as itself.
            async with scoped_group() as tg:
                tg.create_task(pongs.read(stream))
                ident = 0
                while True:
                    ident += 1
                    sent = loop.time()
                    async with asyncio.timeout(t.suspect_after_s):
                        await stream.send(encode_envelope(Ping(ident).to_wire()))
                        await pongs.wait(ident)
                    self._answered(address)
                    await asyncio.sleep(max(sent + t.ping_interval_s - loop.time(), 0.0))
        except TimeoutError:
            self._failed(address, f"no pong within {t.suspect_after_s:g} s")
        except ConnectionClosed as exc:
            self._failed(address, f"closed: {exc.message or exc.kind}")
        except (EnvelopeError, ValueError) as exc:
            self._failed(address, f"bad answer to a ping: {exc}")
        finally:
            await stream.abort()


class _Pongs:
    """The pongs one heartbeat stream brought, read as they come (``read``)."""

    def __init__(self) -> None:
        self.latest = 0  # the highest pong id heard
        self.error: Exception | None = None  # how the stream ended, once it did
        self._changed = asyncio.Event()

    async def read(self, stream: MxclStream) -> None:
        """Read ``stream`` until it ends (its pings answered on the way); ``ValueError``
        for an error answer."""
        try:
            while True:
                answer = parse_envelope(await stream.recv(), _PONG)
                if answer.type == Error.T:
                    raise ValueError(Error.from_wire(answer.header).reason[:200])
                ident = answer.header.get("id")
                if type(ident) is int:
                    self.latest = max(self.latest, ident)
                    self._changed.set()
        except (ConnectionClosed, EnvelopeError, ValueError) as exc:
            self.error = exc
            self._changed.set()

    async def wait(self, ident: int) -> None:
        """Until pong ``ident`` came; the stream's end (``ConnectionClosed``, ...) if first."""
        while self.latest < ident:
            if self.error is not None:
                raise self.error
            self._changed.clear()
            await self._changed.wait()
