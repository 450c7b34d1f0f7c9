"""The coordinator's connection to one stage: dial, attach, send, and sort what comes back.

A link reads its stream all the time (so pings are answered and a closed or
killed stage is noticed at once) and hands each message to the waiting
sequence's inbox by ``seq``. When the stream ends, every sequence that waits on
the link gets ``EngineUnavailable`` naming the stage.

A link is kept up in the background (``keep_up``): dialed and attached at
start, re-dialed at once when its connection ends, then every
``RETRY_INITIAL_S`` doubling to ``RETRY_MAX_S`` (connectivity.py) while it
fails. Each attempt is bounded by ``DIAL_BUDGET_S`` (TCP connect and handshake,
retried within it while refused) plus ``ATTACH_TIMEOUT_S`` (the stage's answer
to ``attach``). A request that finds the link down dials it itself (``ensure``)
rather than waiting for the backoff; if an attempt is already in flight it
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

What a client may read (``EngineUnavailable``, ``/ready``, the connectivity's
error) names the stage by its node id, never by its address; the log lines, for
the operator, give both (``StageAddress.where``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from mlxceld.engine.base import EngineUnavailable
from mlxceld.net import ConnectionClosed, HandshakeFailed, MxclStream, NetError, connect
from mlxceld.net.liveness import watch
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.connectivity import Connectivity, Failure, LinkState, Transition
from mlxceld.types import DEFAULT_SILENCE_S
from mlxceld.wire import Envelope, EnvelopeError, Keyring, encode_envelope, parse_envelope
from mlxceld.wire.address import HostPort

log = logging.getLogger(__name__)

DIAL_BUDGET_S: Final = 5.0  # a stage that does not answer within this is unavailable
ATTACH_TIMEOUT_S: Final = 5.0
# Handshake failures that say nothing about the stage refusing us: retried, then unreachable.
UNREACHABLE_KINDS: Final = frozenset({"unreachable", "at_capacity", "abort", "handshake_timeout"})
# What a failed dial says about the stage, in words that name no address.
_DIAL_WORDS: Final = {
    "unreachable": "nothing accepts connections on its port",
    "handshake_timeout": "it accepted the connection but did not answer the handshake",
    "at_capacity": "it holds its maximum of connections",
    "abort": "it dropped the connection during the handshake",
}

# Why a stage refused ``attach``, in words that name no address (the stage's own name
# its coordinator's and ours: they go to the log).
_ATTACH_WORDS: Final = {
    p.ERR_NOT_COORDINATOR: "it takes commands only from the coordinator its cluster config "
    "names, and this router is not that one: start the stage and the router from the same "
    "cluster config",
    p.ERR_BAD_MESSAGE: "it did not understand the attach (another version of mlxceld?)",
}

Inbox = asyncio.Queue[tuple[int, Envelope] | BaseException]  # (the stage's rank, message)


@dataclass(frozen=True)
class StageAddress:
    node_id: str
    host: str
    port: int
    rank: int
    layers: tuple[int, int]

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def name(self) -> str:
        """The stage as clients read it: its node id, never its address."""
        return f"stage {self.node_id}"

    def where(self) -> str:
        """The stage as the operator's log reads it: node id and address."""
        return f"stage {self.node_id} ({self.address})"


class StageLink:
    def __init__(self, stage: StageAddress, *, keyring: Keyring, origin: HostPort,
                 model_identity: str, cluster: str,
                 inboxes: Callable[[str], Inbox | None],
                 connectivity: Connectivity | None = None,
                 dial_budget_s: float = DIAL_BUDGET_S,
                 silence_s: float = DEFAULT_SILENCE_S) -> None:
        """``silence_s``: how long the attached stage may send nothing before it is silent."""
        self.stage = stage
        self.silence_s = silence_s
        self._keyring = keyring
        self._origin = origin  # the coordinator's address: what we claim, where we dial from
        self._dial_budget = dial_budget_s
        self._model_identity = model_identity
        self._cluster = cluster
        self._inboxes = inboxes  # seq -> its inbox, or None when nobody waits for it
        self._stream: MxclStream | None = None
        self._gone = asyncio.Event()  # set when the attached stream's reader ends
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one attempt at a time
        self._attempts = 0  # attempts finished, so a waiter knows it may share an outcome
        self._waiting: set[str] = set()  # sequences prepared through this link
        self._closing = False
        self.conn = connectivity or Connectivity()

    @property
    def up(self) -> bool:
        return self._stream is not None and not self._stream.closed

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
        raise EngineUnavailable(
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
        """Attach now and re-attach whenever the link is down, until cancelled or closed."""
        while not self._closing:
            if self.up:
                await self._gone.wait()
                continue
            try:
                await self.ensure()
            except EngineUnavailable:
                await asyncio.sleep(self.conn.next_delay())

    async def _attempt(self) -> None:
        stage = self.stage
        if self._closing:
            raise EngineUnavailable(f"{stage.name()}: the engine is closing")
        try:
            stream = await connect(
                stage.host, stage.port, keyring=self._keyring, identity=self._origin.claim(),
                channel=1, budget_s=self._dial_budget, local_addr=self._origin.local_addr())
        except HandshakeFailed as exc:
            if exc.kind in UNREACHABLE_KINDS:
                self._fail("unreachable", f"{stage.name()} is unreachable: "
                           f"{_DIAL_WORDS[exc.kind]} (tried for {self._dial_budget:g} s)", exc)
            self._fail("refused", f"{stage.name()} refused the handshake "
                       f"({exc.kind.replace('_', ' ')})"
                       + (f": {exc.hint}" if exc.hint else ""), exc)
        try:
            async with asyncio.timeout(ATTACH_TIMEOUT_S):
                await stream.send(encode_envelope(
                    {"t": "attach", "model": self._model_identity, "cluster": self._cluster}))
                env = parse_envelope(await stream.recv(), p.ENGINE_SPECS)
        except (TimeoutError, NetError, EnvelopeError) as exc:
            await stream.abort()
            why = (f"no answer within {ATTACH_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError)
                   else _why(exc) if isinstance(exc, ConnectionClosed) else str(exc))
            self._fail("unreachable", f"{stage.name()} did not attach: {why}", exc)
        if env.type != "attached":
            await stream.close()
            message = env.header.get("message", env.type)
            code = env.header.get("code")
            if code == p.ERR_STANDBY:
                self._fail("standby", f"{stage.name()} is in standby: {message}")
            if code == p.ERR_MODEL_MISMATCH:  # its words name the two models, no address
                self._fail("model_mismatch", f"{stage.name()} refused to attach: {message}")
            # Other refusals name addresses (its coordinator's, ours): the log has them.
            log.warning("%s refused to attach: %s (%s)", stage.where(), message, code)
            self._fail("refused", f"{stage.name()} refused to attach ({code}): "
                       + _ATTACH_WORDS.get(str(code), "see the router's log"))
        if tuple(env.header.get("layers", ())) != stage.layers:
            await stream.close()
            self._fail("layers_mismatch",
                       f"{stage.name()} serves layers {env.header.get('layers')}, the cluster "
                       f"config says {list(stage.layers)}: restart it with the same config")
        self._stream = stream
        self._gone = asyncio.Event()
        # Not a task group: the reader outlives the request (or keep_up) that attached the
        # link, and the engine has no scope of its own; aclose cancels and awaits it.
        self._reader = asyncio.ensure_future(self._read(stream, self._gone))
        old = self.conn.state
        since = self.conn.since
        self.conn.attached(time.time())
        log.info("attached %s, layers %s%s", stage.where(), list(stage.layers),
                 (f" after {time.time() - since:.1f} s" if since else "") + f" (was {old})"
                 if old != "connecting" else "")

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

    async def send(self, header: dict[str, Any], tensors: list[Any] | None = None) -> None:
        stream = self._stream
        if stream is None or stream.closed:
            error = self.conn.error
            raise EngineUnavailable(f"{self.stage.name()} is not connected"
                                    + (f": {error}" if error else ""))
        try:
            await stream.send(encode_envelope(header, tensors or ()))
        except ConnectionClosed as exc:
            raise EngineUnavailable(f"{self.stage.name()}: sending failed: {_why(exc)}",
                                    retry_after_s=self.retry_after_s) from exc

    def track(self, seq: str) -> None:
        self._waiting.add(seq)

    def untrack(self, seq: str) -> None:
        self._waiting.discard(seq)

    async def _read(self, stream: MxclStream, gone: asyncio.Event) -> None:
        """Deliver what the stage sends, with a heartbeat beside; when the stream ends,
        fail every sequence waiting on it, naming the stage and why."""
        ended: ConnectionClosed | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                heartbeat = tg.create_task(watch(stream, self.silence_s, self.stage.name()))
                ended = await self._deliver(stream)
                heartbeat.cancel()
        finally:
            self._ended(stream, ended, gone)

    async def _deliver(self, stream: MxclStream) -> ConnectionClosed:
        """Hand each message to its sequence's inbox until the stream ends (returned)."""
        while True:
            try:
                payload = await stream.recv()
            except ConnectionClosed as exc:
                return exc
            try:
                env = parse_envelope(payload, p.ENGINE_SPECS)
            except EnvelopeError as exc:
                log.warning("%s sent a bad message: %s", self.stage.where(), exc.reason)
                continue
            seq = env.header.get("seq")
            inbox = self._inboxes(seq) if isinstance(seq, str) else None
            if inbox is None:
                if env.type == "error":
                    log.warning("%s: %s (%s)", self.stage.where(),
                                env.header.get("message"), env.header.get("code"))
                continue
            inbox.put_nowait((self.stage.rank, env))

    def _ended(self, stream: MxclStream, ended: ConnectionClosed | None,
               gone: asyncio.Event) -> None:
        """``ended`` None: the reader was cancelled (the engine is closing)."""
        silent = ended is not None and ended.kind == "silent"
        if ended is None:
            message = f"{self.stage.name()} is unavailable: the engine is closing"
        elif silent:
            message = f"{self.stage.name()} is silent: {ended.reason}"
        else:
            message = f"{self.stage.name()} is unavailable: {_why(ended)}"
        failure = EngineUnavailable(message, retry_after_s=self.retry_after_s)
        for seq in list(self._waiting):
            inbox = self._inboxes(seq)
            if inbox is not None:
                inbox.put_nowait(failure)
        self._waiting.clear()
        if self._stream is stream and not self._closing:
            now = time.time()
            self._log(self.conn.silent(message, now) if silent
                      else self.conn.lost(message, now))
        gone.set()

    async def aclose(self) -> None:
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._stream is not None:
            await self._stream.close("coordinator stopping")


def _why(exc: ConnectionClosed) -> str:
    """Why a stream ended, in words that name no address (a failed write's do)."""
    if exc.kind == "abort":
        return "the connection was reset"
    if exc.kind == "closed":
        return f"it closed the connection ({exc.reason})" if exc.reason \
            else "it closed the connection"
    return exc.reason or exc.kind.replace("_", " ")
