"""The coordinator's connection to one stage: dial, attach, send, and sort what comes back.

A link reads its stream all the time (so pings are answered and a closed or
killed stage is noticed at once) and hands each message to the waiting
sequence's inbox by ``seq``. When the stream ends, every sequence that waits on
the link gets ``EngineUnavailable`` naming the stage.

A link is kept up in the background (``keep_up``): dialed and attached at
start, re-dialed at once when its connection ends, then every
``RETRY_INITIAL_S`` doubling to ``RETRY_MAX_S`` (connectivity.py) while it
fails. Each attempt (``attaching.py``: dial, then ``attach``) is bounded by
``DIAL_BUDGET_S`` plus ``ATTACH_TIMEOUT_S``. A request that finds the link down dials
it itself (``ensure``) rather than waiting for the backoff; if an attempt is already in flight it
shares that attempt's outcome instead of starting another, so it waits at most
one attempt's bound. Each change of state (attached, lost, unreachable,
refused, standby, mismatch, silent) is logged once, not every retry.

An attached link has a heartbeat (``mlxceld.net.liveness.watch``): a stage that
sends nothing, not even a pong, for ``silence_s`` (``DEFAULT_SILENCE_S``, 3 s; the
router's ``[serve] stage_silence_s``) is *silent*: its host sleeps or lost its
network, and no RST will ever tell. The connection is dropped at once, every
sequence waiting on it fails naming the stage, and the link reads ``silent``
(connectivity.py) until a re-dial attaches it again: meanwhile ``check_admits``
refuses requests at once (503 with ``Retry-After``) instead of letting each wait
for a dial to a host that does not answer.

Handover (``rekey``: the keyring's primary changed, a secret rotation's ``use``): the
link dials and attaches a second stream under the new primary in the background and
sends every new sequence over it. A sequence is pinned to the stream it was prepared on
(``track``: its commands go there, the stage answers there) until it moves: once its
prompt is sent (``decoding``) it is *adopted* over the new stream (``adopt``; the stage
answers ``adopted`` over the old one after everything it sent there, and what the new
stream brings for the sequence before that is held back, so its tokens stay in order).
The old stream is finished (our close frame, then the stage's, nothing in flight lost)
once no sequence is left on it: at once, or after the prompts being sent end. So a
long sequence does not keep the old key in use, and when the rotation removes it no
stream of ours is under it and nothing is cut. A handover that cannot dial leaves the
old stream in use and is tried again with the link's backoff; a stream that ends fails
only the sequences pinned to it.

A stage that failed on its host (its worker could not load, and is not restarted)
is answered for by its daemon's stand-in (``standin.py``): ``attach`` gets ``error``
code ``stage_failed``, and the link reads ``failed`` with the stand-in's words (the
stage, the node, the reason, the next step) until a re-dial attaches the stage
again: within one backoff step (at most ``RETRY_MAX_S``) once it serves, and at once
for a request, which dials on demand.

What a client may read (``EngineUnavailable``, ``/ready``, the connectivity's
error) names the stage by its node id, never by its address; the log lines, for
the operator, give both (``StageAddress.where``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Final, NoReturn

from mlxceld.engine.base import EngineUnavailable
from mlxceld.net import ConnectionClosed, MxclStream
from mlxceld.net.liveness import read_watched
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.attaching import (
    DIAL_BUDGET_S,
    OpenFailed,
    StageAddress,
    open_stream,
    why_ended,
)
from mlxceld.pipeline.connectivity import Connectivity, Failure, LinkState, Transition
from mlxceld.pipeline.messages import Adopt, Adopted, Cache
from mlxceld.tasks import Background
from mlxceld.types import DEFAULT_SILENCE_S
from mlxceld.wire import Envelope, EnvelopeError, Keyring, encode_envelope, parse_envelope
from mlxceld.wire.address import HostPort
from mlxceld.wire.messages import Message, MessageError
from mlxceld.wire.transport_messages import Attach, error_in

log = logging.getLogger(__name__)

_HANDED_OVER: Final = "handed over to a stream under the new primary key"

Inbox = asyncio.Queue[tuple[int, Envelope] | BaseException]  # (the stage's rank, message)


class StageLost(EngineUnavailable):
    """A stage this sequence ran on is gone: its connection ended or went silent, or the
    stage before it cannot reach it. A router that holds such sequences replays them on a
    working plan (``replay.py``); otherwise it is the 503 it always was."""


class StageDraining(EngineUnavailable):
    """A stage refused a new sequence: it is stopping (``draining``: its host stops its
    worker, as a re-plan that replaces a tensor group does before the new plan's stages
    load, or a restart). A router that holds lost stages' sequences holds this one too,
    for the engine that works next (``replay.py``); otherwise a 503 with Retry-After."""


class StageLink:
    def __init__(self, stage: StageAddress, *, keyring: Keyring, origin: HostPort,
                 model_identity: str, cluster: str,
                 inboxes: Callable[[str], Inbox | None],
                 connectivity: Connectivity | None = None,
                 dial_budget_s: float = DIAL_BUDGET_S,
                 silence_s: float = DEFAULT_SILENCE_S,
                 cache: tuple[str | None, int | None] = (None, None),
                 on_cache: Callable[[int, Cache], None] | None = None,
                 on_attached: Callable[[int], None] | None = None) -> None:
        """``silence_s``: how long the attached stage may send nothing before it is silent;
        ``cache``: the prompt cache's epoch and bound, for ``attach``;
        ``on_cache``: told what the stage says of its prompt cache (``cache``, no
        sequence's); ``on_attached``: told each time a dial attaches (not a handover)."""
        self.stage = stage
        self._cache = cache
        self._on_cache = on_cache
        self._on_attached = on_attached
        self.silence_s = silence_s
        self._keyring = keyring
        self._origin = origin  # the coordinator's address: what we claim, where we dial from
        self._dial_budget = dial_budget_s
        self._model_identity = model_identity
        self._cluster = cluster
        self._inboxes = inboxes  # seq -> its inbox, or None when nobody waits for it
        self._stream: MxclStream | None = None  # the stream new sequences go over
        self._wake = asyncio.Event()  # for keep_up: the stream ended, or the key changed
        # One reader per stream, old ones included: they outlive the request (or keep_up)
        # that attached the link, and the link has no scope of its own; aclose ends them.
        self._readers = Background(f"the link to stage {stage.node_id}")
        self._lock = asyncio.Lock()  # one attempt at a time
        self._attempts = 0  # attempts finished, so a waiter knows it may share an outcome
        self._pinned: dict[str, MxclStream] = {}  # sequence -> the stream it is on
        self._decoding: set[str] = set()  # sequences whose prompt is sent: they may move
        self._adopting: dict[str, MxclStream] = {}  # sequence -> the stream it moves to
        self._held: dict[str, list[Envelope]] = {}  # what the new stream brought meanwhile
        self._handover_failing = False  # the last handover could not attach (logged once)
        self._closing = False
        self.conn = connectivity or Connectivity()
        self.cache_budget: int | None = None  # the stage's prompt cache bound, as it said

    @property
    def up(self) -> bool:
        return self._stream is not None and not self._stream.closed

    @property
    def stale(self) -> bool:
        """Attached under another key than the keyring's primary: to be handed over."""
        return self.up and self._stream is not None \
            and self._stream.key_id != self._keyring.primary_id

    def rekey(self) -> None:
        """The keyring changed: ``keep_up`` hands the link over if it is stale."""
        self._wake.set()

    @property
    def state(self) -> LinkState:
        """The connectivity state, ``disconnected`` already while the reader winds down."""
        if self.conn.state == "attached" and not self.up:
            return "disconnected"
        return self.conn.state

    def describe(self) -> dict[str, Any]:
        """For ``/ready``: the stage (by node id), whether we reach it, and why not."""
        up = self.up
        return {"stage": self.stage.node_id, "layers": list(self.stage.layers),
                "connected": up, "state": self.state,
                "error": None if up else self.conn.error, "since": self.conn.since,
                "failures": self.conn.failures}

    def stats(self) -> dict[str, Any]:
        """For the router's stats (``mlxctl status``, the operator's): ``describe``, the
        stage's address and silence bound, and ``rtt_ms``: the round trip of the latest
        heartbeat ping answered on the attached connection (pings go while the link is
        quiet, ``net/liveness.py``), None before one is or while not attached."""
        rtt = self._stream.rtt_s if self._stream is not None and self.up else None
        return {**self.describe(), "address": self.stage.address,
                "silence_s": self.silence_s,
                "rtt_ms": None if rtt is None else round(rtt * 1000, 3)}

    def check_admits(self) -> None:
        """``EngineUnavailable`` at once while the stage is silent (see the module doc)."""
        if self.conn.admits:
            return
        quiet = time.time() - (self.conn.since or time.time())
        raise StageLost(
            f"{self.stage.name()} is silent (for {quiet:.0f} s): it answers nothing, its "
            "host may be asleep or off the network; requests are served again as soon as "
            f"it answers (retry in {self.retry_after_s} s)", retry_after_s=self.retry_after_s)

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.silence_s))

    async def ensure(self) -> None:
        """Connect and attach unless already attached; ``EngineUnavailable`` otherwise.

        Waits at most for one attempt (the dial budget + ``ATTACH_TIMEOUT_S``): when
        another attempt finishes while this one waits for it, its outcome is ours too.
        """
        if self.up:
            return
        seen = self._attempts
        async with self._lock:
            if self.up:
                return
            if self._attempts != seen:  # an attempt ended since we came: it failed
                raise EngineUnavailable(self.conn.error or f"{self.stage.name()} is "
                                        "unavailable")
            try:
                await self._attempt()
            finally:
                self._attempts += 1

    async def keep_up(self) -> None:
        """Attach now and re-attach whenever the link is down, and hand it over when its
        key is not the primary any more, until cancelled or closed."""
        while not self._closing:
            if self.up and not self.stale:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await (self.hand_over() if self.up else self.ensure())
            except EngineUnavailable:
                await asyncio.sleep(self.conn.next_delay())

    async def hand_over(self) -> None:
        """A stream under the primary for new sequences (see the module doc); the old one
        is finished once its last sequence ends. ``EngineUnavailable`` if the new one
        cannot be attached: the old one stays in use."""
        async with self._lock:
            old = self._stream
            if old is None or not self.stale:
                return
            try:
                new, _ = await self._open()
            except OpenFailed as exc:  # logged once, then at debug level until it works
                log.log(logging.DEBUG if self._handover_failing else logging.WARNING,
                        "%s stays on key %s for now (retrying in the background): %s%s",
                        self.stage.where(), old.key_id.hex(), exc.message,
                        f" [{exc.__cause__}]" if exc.__cause__ else "")
                self._handover_failing = True
                raise EngineUnavailable(exc.message) from exc
            self._handover_failing = False
            self._install(new)
            on_old = [q for q, s in self._pinned.items() if s is old]
            moving = [q for q in on_old if q in self._decoding]
            log.info("%s handed over to key %s; of the %d sequence(s) on the stream under "
                     "key %s, %d move over, the others end there", self.stage.where(),
                     new.key_id.hex(), len(on_old), old.key_id.hex(), len(moving))
            for seq in moving:
                await self._adopt(seq)
            self._finish_if_done(old)

    async def decoding(self, seq: str) -> None:
        """``seq``'s prompt is sent: from now on it may move to the current stream."""
        self._decoding.add(seq)
        if self._pinned.get(seq, self._stream) is not self._stream:
            await self._adopt(seq)

    async def _adopt(self, seq: str) -> None:
        """Ask the stage to answer ``seq`` over the current stream (see the module doc);
        a failed send leaves it where it is."""
        new = self._stream
        if new is None or seq in self._adopting:
            return
        self._adopting[seq] = new
        try:
            await new.send(encode_envelope(Adopt(seq).to_wire()))
        except ConnectionClosed:
            self._adopting.pop(seq, None)

    def _adopted(self, seq: str, old: MxclStream) -> None:
        """The stage sent ``seq``'s last message over ``old``: deliver what the new stream
        brought meanwhile, and finish ``old`` if that was its last sequence."""
        new = self._adopting.pop(seq, None)
        held = self._held.pop(seq, [])
        if new is None or self._pinned.get(seq) is not old:
            return
        self._pinned[seq] = new
        inbox = self._inboxes(seq)
        for env in held:
            if inbox is not None:
                inbox.put_nowait((self.stage.rank, env))
        self._finish_if_done(old)

    def _finish_if_done(self, stream: MxclStream) -> None:
        """Finish a handed-over stream that no sequence uses any more."""
        if stream is self._stream or stream.closed or stream.finishing \
                or any(s is stream for s in self._pinned.values()):
            return
        log.info("%s: no sequence is left on the stream under key %s; finishing it",
                 self.stage.where(), stream.key_id.hex())
        stream.finish(_HANDED_OVER)

    async def _attempt(self) -> None:
        if self._closing:
            raise EngineUnavailable(f"{self.stage.name()}: the engine is closing")
        try:
            stream, self.cache_budget = await self._open()
        except OpenFailed as exc:
            self._fail(exc.failure, exc.message, exc.__cause__)
        self._install(stream)
        old = self.conn.state
        since = self.conn.since
        self.conn.attached(time.time())
        if self._on_attached is not None:
            self._on_attached(self.stage.rank)
        log.info("attached %s, layers %s%s", self.stage.where(), list(self.stage.layers),
                 (f" after {time.time() - since:.1f} s" if since else "") + f" (was {old})"
                 if old != "connecting" else "")

    def _install(self, stream: MxclStream) -> None:
        """``stream`` is the one new sequences go over; read it until it ends."""
        self._stream = stream
        self._readers.spawn(self._read(stream))

    async def _open(self) -> tuple[MxclStream, int | None]:
        """A new stream to the stage, attached, and the prompt cache bound it said
        (``attaching.open_stream``); ``OpenFailed`` saying why not."""
        return await open_stream(self.stage, keyring=self._keyring, origin=self._origin,
                                 dial_budget_s=self._dial_budget, attach=Attach(
                                     self._model_identity, self._cluster, *self._cache))

    def _fail(self, failure: Failure, message: str,
              cause: BaseException | None = None) -> NoReturn:
        self._log(self.conn.failed(failure, message, time.time()), cause)
        raise EngineUnavailable(message) from cause

    def _log(self, change: Transition | None, cause: BaseException | None = None) -> None:
        """One line per change of state; a repeated failure only at debug level. The
        cause's own words (addresses included) go to the log only."""
        detail = f" [{cause}]" if cause is not None and str(cause) else ""
        if change is None:
            log.debug("%s still %s: %s%s", self.stage.where(), self.conn.state,
                      self.conn.error, detail)
        elif change.new == "standby":
            log.info("%s is in standby (prepared, not activated yet); retrying until it is",
                     self.stage.where())
        else:
            log.warning("%s is %s (was %s): %s%s; retrying in the background",
                        self.stage.where(), change.new.replace("_", " "), change.old,
                        change.reason, detail)

    async def send(self, message: Message, tensors: list[Any] | None = None) -> None:
        """Send over the stream the message's sequence is pinned to, else the current
        one."""
        header = message.to_wire()
        seq = header.get("seq")
        stream = self._pinned.get(seq, self._stream) if isinstance(seq, str) else self._stream
        if stream is None or stream.closed:
            error = self.conn.error
            raise EngineUnavailable(f"{self.stage.name()} is not connected"
                                    + (f": {error}" if error else ""))
        try:
            await stream.send(encode_envelope(header, tensors or ()))
        except ConnectionClosed as exc:
            raise EngineUnavailable(f"{self.stage.name()}: sending failed: {why_ended(exc)}",
                                    retry_after_s=self.retry_after_s) from exc

    def track(self, seq: str) -> None:
        """Pin ``seq`` to the current stream: its commands and answers go over it."""
        if self._stream is not None:
            self._pinned[seq] = self._stream

    def untrack(self, seq: str) -> None:
        """``seq`` ended; a handed-over stream whose last sequence it was is finished."""
        stream = self._pinned.pop(seq, None)
        self._decoding.discard(seq)
        self._adopting.pop(seq, None)
        self._held.pop(seq, None)
        if stream is not None:
            self._finish_if_done(stream)

    async def _read(self, stream: MxclStream) -> None:
        """Deliver what the stage sends, with a heartbeat beside; when the stream ends,
        fail every sequence pinned to it, naming the stage and why."""
        ended: ConnectionClosed | None = None
        try:
            ended = await read_watched(stream, self.silence_s, self.stage.name(),
                                       lambda payload: self._deliver(stream, payload))
        finally:
            self._ended(stream, ended)

    def _deliver(self, stream: MxclStream, payload: bytes) -> None:
        """Hand a message to its sequence's inbox."""
        try:
            env = parse_envelope(payload, p.ENGINE_SPECS)
        except EnvelopeError as exc:
            log.warning("%s sent a bad message: %s", self.stage.where(), exc.reason)
            return
        seq = env.header.get("seq")
        try:
            if env.type == "cache":
                if self._on_cache is not None:
                    self._on_cache(self.stage.rank, Cache.from_wire(env.header))
                return
            if env.type == "adopted":
                self._adopted(Adopted.from_wire(env.header).seq, stream)
                return
        except MessageError as exc:
            log.warning("%s sent a bad %s: %s", self.stage.where(), env.type, exc.reason)
            return
        if isinstance(seq, str) and self._adopting.get(seq) is stream:  # moving here
            self._held.setdefault(seq, []).append(env)  # after ``adopted``
            return
        inbox = self._inboxes(seq) if isinstance(seq, str) else None
        if inbox is None:
            if env.type == "error":
                error = error_in(env)
                log.warning("%s: %s (%s)", self.stage.where(), error.message, error.code)
            return
        inbox.put_nowait((self.stage.rank, env))

    def _ended(self, stream: MxclStream, ended: ConnectionClosed | None) -> None:
        """``ended`` None: the reader was cancelled (the engine is closing)."""
        silent = ended is not None and ended.kind == "silent"
        if ended is None:
            message = f"{self.stage.name()} is unavailable: the engine is closing"
        elif silent:
            message = f"{self.stage.name()} is silent: {ended.reason}"
        else:
            message = f"{self.stage.name()} is unavailable: {why_ended(ended)}"
        failure = (EngineUnavailable if ended is None else StageLost)(
            message, retry_after_s=self.retry_after_s)
        lost = {q for q, s in self._pinned.items() if s is stream}
        lost |= {q for q, s in self._adopting.items() if s is stream}  # were moving here
        for seq in lost:
            self._pinned.pop(seq, None)
            self._adopting.pop(seq, None)
            self._held.pop(seq, None)
            inbox = self._inboxes(seq)
            if inbox is not None:
                inbox.put_nowait(failure)
        if self._stream is stream:
            if not self._closing:
                now = time.time()
                self._log(self.conn.silent(message, now) if silent
                          else self.conn.lost(message, now))
            self._wake.set()

    async def aclose(self) -> None:
        self._closing = True
        streams = {id(s): s for s in (self._stream, *self._pinned.values()) if s is not None}
        await self._readers.aclose()
        for stream in streams.values():
            await stream.close("coordinator stopping")
