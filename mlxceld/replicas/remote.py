"""``RemoteEngine``: an ``Engine`` over a link to one serving node (``service.py``).

A router's pool (``replicas/pool.py``) holds one per node; it is a pool member:
``node_id``, ``address`` (the node's serving listener as last resolved), ``role``,
``state()`` and ``last_error()``.

The link (``keep_linked``, run until cancelled): ``resolve()`` (the node's serving
listener ``host:port``, asked again before every dial, within ``RESOLVE_S``), dial
it as ``origin`` (``connect_as``, channel 1, within ``DIAL_BUDGET_S``), ``attach``
(answered within ``ATTACH_TIMEOUT_S``), each as ``attaching.py`` says; on any failure
wait ``RETRY_INITIAL_S`` doubling to ``RETRY_MAX_S`` and try again. The attached link
has a heartbeat (``net/liveness.watch``, ``silence_s``): a node that sends nothing, not
even a pong, that long (stopped, asleep, off the network: no RST comes) is dropped.

States: ``connecting`` until the first attempt ends; ``up`` while attached (only then
does ``generate`` send anything); ``down`` once an attempt failed or the link ended,
until a re-dial attaches again. ``last_error()`` says why it is down, naming the node
by its id (its address and the causes' words go to the log only; never the secret),
and a resolver's ``MlxceldError`` message, which names no address (a router node's
``ServingFinder``: another model, no serving listener yet, its agent unreachable).

A sequence (``generate``) is sent over the current stream and its answers are read
from that stream only (``protocol.py``'s result-frame rule): a ``token`` for a ``seq``
that was not sent over the stream it came on is dropped. An ``error`` ends it, raised as
``answers.py`` says (``busy``, ``unavailable`` and ``draining`` as ``EngineUnavailable``
naming the node: the pool tries another, and after ``draining`` it passes the node over
until ``draining_until``). The stream ending ends every sequence on it with ``EngineUnavailable``
naming the node, at once. Closing the generator early sends ``cancel`` (the node frees
the sequence).

The node's load (``node_sequences``: every sequence its engine runs, its own OpenAI
clients' included, from its latest ``load``; None before one came): what this router
sent it is ``active_sequences()``, so the difference is the work it has that the pool
cannot see. A pool that routes by least outstanding work may weigh a member by
``max(active_sequences(), node_sequences)``.

Rekey (``rekey``: the keyring's primary changed, a secret rotation's ``use``):
``keep_linked`` dials and attaches a second stream under the new primary; new sequences
go over it, and every sequence running on the old one moves there, however long it runs
(``adopt`` over the new stream; the node answers ``adopted`` over the old one after all
it sent there, and what the new stream brings for the sequence before that is held
back, so its tokens stay in order). A sequence the node had not answered yet is asked
again at its first answer (its ``generate`` and the ``adopt`` went over two
connections, so the node may have had the ``adopt`` first and ignored it). The old
stream is finished (our close frame) once no sequence is left on it, so when the
rotation removes the old key no stream of ours is under it and nothing is cut. A
stream that ends fails the sequences on it and those moving to it. A handover that
cannot attach leaves the old stream in use and is retried with the backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from mlxceld.engine.base import (
    EngineError,
    EngineUnavailable,
    GenerationRequest,
    TokenOutput,
)
from mlxceld.net import ConnectionClosed, MxclStream
from mlxceld.net.liveness import read_watched
from mlxceld.pipeline.connectivity import RETRY_INITIAL_S, RETRY_MAX_S
from mlxceld.replicas import messages as m
from mlxceld.replicas import protocol as p
from mlxceld.replicas.answers import DRAINING_RETRY_S, refusal, token_output
from mlxceld.replicas.attaching import DIAL_BUDGET_S, LinkFailed, attach, dial, resolved
from mlxceld.tasks import Background
from mlxceld.wire import Envelope, EnvelopeError, SecretStore, encode_envelope, parse_envelope
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import Attach, CodedError, error_in

log = logging.getLogger(__name__)

@dataclass
class _Seq:
    stream: MxclStream  # the stream it was sent over, or moved to: its answers come from there
    inbox: asyncio.Queue[Envelope | BaseException] = field(default_factory=asyncio.Queue)
    moving: MxclStream | None = None  # the stream it moves to (``adopt`` sent) until ``adopted``
    held: list[Envelope] = field(default_factory=list)  # what ``moving`` brought meanwhile
    answered: bool = False  # the node said something for it over ``stream``
    again: bool = False  # ``adopt`` went before any answer: said again at the first one


class RemoteEngine:
    def __init__(self, node_id: str, resolve: Callable[[], Awaitable[str]], *,
                 keyring: SecretStore, origin: str, model_identity: str, cluster: str,
                 silence_s: float, dial_budget_s: float = DIAL_BUDGET_S,
                 role: str = "hybrid") -> None:
        """``context_length`` and ``max_batch`` are the node's, from its ``attached``
        (0 until the first attach); ``role``: what the node must say it is in its
        ``attached`` (a node of another role is not attached: listed in the wrong pool)."""
        self.node_id = node_id
        self.role = role
        self.address = ""
        self.model_id = model_identity
        self.context_length = 0
        self.max_batch = 0
        self.silence_s = silence_s
        self._resolve = resolve
        self._keyring = keyring
        self._origin = origin
        self._model_identity = model_identity
        self._cluster = cluster
        self._dial_budget_s = dial_budget_s
        self._stream: MxclStream | None = None  # the stream new sequences go over
        self._streams: set[MxclStream] = set()  # every stream still read, old ones too
        self._state = "connecting"
        self._error: str | None = None
        self._seqs: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        # Readers and cancels: they outlive the request (or keep_linked) that started
        # them, and the engine has no scope of its own; aclose ends them.
        self._tasks = Background(f"the engine of node {node_id}")
        self._closing = False
        self.node_sequences: int | None = None  # the node's last ``load`` (see above)
        self.draining_until = 0.0  # loop clock: a ``draining`` refusal's + DRAINING_RETRY_S

    # -- the member's face --------------------------------------------------------------

    def state(self) -> str:
        return self._state

    def last_error(self) -> str | None:
        return self._error

    def active_sequences(self) -> int:
        return len(self._seqs)

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.silence_s))

    def rekey(self) -> None:
        """The keyring changed: ``keep_linked`` hands the link over if its key is stale."""
        self._wake.set()

    @property
    def _stale(self) -> bool:
        return self._stream is not None and self._stream.key_id != self._keyring.primary_id

    # -- the link -----------------------------------------------------------------------

    async def keep_linked(self) -> None:
        """Keep one attached stream to the node, under the primary key, until cancelled."""
        delay = RETRY_INITIAL_S
        while not self._closing:
            if self._state == "up" and not self._stale:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                stream = await self._open()
            except LinkFailed as exc:
                if self._state == "up":  # a handover that failed: the old stream serves on
                    log.warning("node %s stays on its old key for now: %s", self.node_id, exc)
                else:
                    self._down(str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            delay = RETRY_INITIAL_S
            old = self._install(stream)
            if old is not None:
                await self._hand_over(old)

    def _install(self, stream: MxclStream) -> MxclStream | None:
        """``stream`` is the one new sequences go over; the one that was, if any."""
        old, self._stream = self._stream, stream
        self._streams.add(stream)
        if self._state != "up":
            log.info("attached node %s (%s): context %d, max_batch %d", self.node_id,
                     self.address, self.context_length, self.max_batch)
        self._state, self._error = "up", None
        self._tasks.spawn(self._read(stream))
        return old

    async def _hand_over(self, old: MxclStream) -> None:
        """Move every sequence on ``old`` to the current stream (``adopt``); ``old`` is
        finished once none is left on it."""
        moving = [(q, s) for q, s in self._seqs.items() if s.stream is old]
        log.info("node %s handed over to key %s; %d sequence(s) move over from key %s",
                 self.node_id, self._stream.key_id.hex() if self._stream else None,
                 len(moving), old.key_id.hex())
        for seq, sequence in moving:
            await self._adopt(seq, sequence)
        self._finish_if_done(old)

    async def _adopt(self, seq: str, sequence: _Seq) -> None:
        """Ask the node to answer ``seq`` over the current stream from now on; a send that
        fails leaves it where it is."""
        new = self._stream
        if new is None or new is sequence.stream or sequence.moving is not None:
            return
        sequence.moving, sequence.again = new, not sequence.answered
        await self._say_adopt(seq, sequence, new)

    async def _say_adopt(self, seq: str, sequence: _Seq, new: MxclStream) -> None:
        try:
            await new.send(encode_envelope(m.Adopt(seq).to_wire()))
        except ConnectionClosed:
            if sequence.moving is new:
                sequence.moving, sequence.held = None, []

    def _adopted(self, seq: str, old: MxclStream) -> None:
        """The node sent ``seq``'s last message over ``old``: what the new stream brought
        meanwhile is delivered, and ``old`` finished if that was its last sequence."""
        sequence = self._seqs.get(seq)
        if sequence is None or sequence.stream is not old or sequence.moving is None:
            return
        held, sequence.held = sequence.held, []
        sequence.stream, sequence.moving = sequence.moving, None
        for env in held:
            sequence.inbox.put_nowait(env)
        self._finish_if_done(old)
        if sequence.stream is not self._stream:  # handed over again meanwhile: on it goes
            self._tasks.spawn(self._adopt(seq, sequence))

    def _down(self, message: str) -> None:
        if self._state != "down" or self._error != message:
            log.warning("node %s is down: %s", self.node_id, message)
        self._state, self._error = "down", message

    async def _open(self) -> MxclStream:
        """Resolve, dial and attach (``attaching.py``); ``LinkFailed`` saying why not."""
        name = f"node {self.node_id}"
        self.address = await resolved(name, self._resolve)
        stream = await dial(name, self.address, origin=self._origin, keyring=self._keyring,
                            budget_s=self._dial_budget_s)
        attached = await attach(stream, name, Attach(self._model_identity, self._cluster),
                                self.role)
        self.context_length, self.max_batch = attached.context_length, attached.max_batch
        return stream

    async def _read(self, stream: MxclStream) -> None:
        """Deliver what the node sends, with a heartbeat beside, until the stream ends."""
        ended: ConnectionClosed | None = None
        try:
            ended = await read_watched(stream, self.silence_s, f"node {self.node_id}",
                                       lambda payload: self._deliver(stream, payload))
        finally:
            self._ended(stream, ended)

    def _deliver(self, stream: MxclStream, payload: bytes) -> None:
        """Hand a message to its sequence, if that was sent over ``stream`` or moved there
        (the result-frame rule; held back until ``adopted`` while it moves); else drop
        it."""
        try:
            env = parse_envelope(payload, p.ROUTER_SPECS)
        except EnvelopeError as exc:
            log.warning("node %s sent a bad message: %s", self.node_id, exc.reason)
            return
        if env.type == "load":
            with contextlib.suppress(MessageError):  # a load that does not add up: unsaid
                self._load(stream, m.Load.from_wire(env.header).sequences)
            return
        seq = env.header.get("seq")
        if env.type == "adopted" and isinstance(seq, str):
            self._adopted(seq, stream)
            return
        sequence = self._seqs.get(seq) if isinstance(seq, str) else None
        if sequence is not None and sequence.stream is stream:
            sequence.answered = True
            if sequence.again and sequence.moving is not None:  # the node knows it now
                sequence.again = False
                self._tasks.spawn(self._say_adopt(str(seq), sequence, sequence.moving))
            sequence.inbox.put_nowait(env)
        elif sequence is not None and sequence.moving is stream:
            sequence.held.append(env)
        elif env.type == "error":
            error = error_in(env)
            log.warning("node %s: %s (%s)", self.node_id, error.message, error.code or None)

    def _load(self, stream: MxclStream, sequences: int) -> None:
        if stream is self._stream:
            self.node_sequences = sequences

    def _ended(self, stream: MxclStream, ended: ConnectionClosed | None) -> None:
        if ended is None:
            message = f"node {self.node_id} is unavailable: the router is closing"
        elif ended.kind == "silent":
            message = f"node {self.node_id} is silent: {ended.reason}"
        else:
            message = f"node {self.node_id} is unavailable: the connection ended ({ended.kind})"
        failure = EngineUnavailable(message, retry_after_s=self.retry_after_s)
        self._streams.discard(stream)
        for sequence in self._seqs.values():
            if stream in (sequence.stream, sequence.moving):  # moving: what came is unsure
                sequence.inbox.put_nowait(failure)
        if self._stream is stream:
            self._stream = None
            if not self._closing:
                self._down(message)
            self._wake.set()

    def _finish_if_done(self, stream: MxclStream) -> None:
        """Finish a handed-over stream no sequence uses any more."""
        if stream is self._stream or stream.closed or stream.finishing \
                or any(stream in (s.stream, s.moving) for s in self._seqs.values()):
            return
        stream.finish("handed over to a stream under the new primary key")

    # -- sequences ----------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        seq, sequence = self._open_seq(uuid.uuid4().hex)
        tokens = self._tokens(seq, sequence, request)
        try:
            await self._send(sequence, m.Generate(seq, request.params), request)
        except BaseException:
            await tokens.aclose()
            raise
        async with contextlib.aclosing(tokens):
            async for out in tokens:
                yield out

    async def expect(self, seq: str, request: GenerationRequest, prefill: str
                     ) -> AsyncGenerator[TokenOutput, None]:
        """Tell this (decode) node that ``seq``'s cache comes from ``prefill`` (that node's
        serving address); the sequence's tokens, as ``generate``'s, once it came. The
        ``expect`` is sent before this returns."""
        seq, sequence = self._open_seq(seq)
        tokens = self._tokens(seq, sequence, request)
        try:
            await self._send(sequence, m.Expect(seq, request.params, prefill), request)
        except BaseException:
            await tokens.aclose()
            raise
        return tokens

    async def prefill(self, seq: str, request: GenerationRequest, *, decode_target: str,
                      compression: str, within_s: float) -> m.Prefilled:
        """Have this (prefill) node prefill ``request`` and hand its cache to
        ``decode_target``; its ``prefilled`` (bytes, encode_ms, send_ms), or the
        node's refusal raised as ``generate``'s are; ``EngineUnavailable`` when no answer
        comes within ``within_s``."""
        seq, sequence = self._open_seq(seq)
        answered = False
        try:
            await self._send(sequence, m.Prefill(seq, request.params, decode_target,
                                                 m.parse_mode(compression)), request)
            try:
                async with asyncio.timeout(within_s):
                    item = await sequence.inbox.get()
            except TimeoutError:
                raise EngineUnavailable(f"node {self.node_id} did not prefill within "
                                        f"{within_s:g} s", retry_after_s=1) from None
            answered = True
            if isinstance(item, BaseException):
                raise item
            if item.type == "error":
                raise self._refused(error_in(item))
            if item.type != "prefilled":
                raise EngineError(f"node {self.node_id} sent '{item.type}' for a prefill")
            try:
                return m.Prefilled.from_wire(item.header)
            except MessageError as exc:
                raise EngineError(f"node {self.node_id} sent a bad 'prefilled': "
                                  f"{exc.reason}") from None
        finally:  # unanswered, the node stops the prefill: nothing is handed off
            self._end(seq, sequence, cancel=not answered)

    def forget(self, seq: str) -> None:
        """End ``seq`` here and on the node (``cancel``) if it is still in flight: for an
        ``expect`` whose tokens were never read (an unstarted generator's ``aclose`` runs
        none of its code)."""
        sequence = self._seqs.get(seq)
        if sequence is not None:
            self._end(seq, sequence, cancel=True)

    def _end(self, seq: str, sequence: _Seq, *, cancel: bool) -> None:
        """``seq`` is over here, if it still is ours: ``cancel`` it on the node too, over
        each stream it may belong to there (one moving has two); a handed-over stream it
        was the last on is finished."""
        if self._seqs.get(seq) is not sequence:
            return
        del self._seqs[seq]
        for stream in (sequence.stream, sequence.moving):
            if stream is None:
                continue
            if cancel and not stream.closed:
                self._tasks.spawn(self._cancel(stream, seq))
            else:
                self._finish_if_done(stream)

    def _open_seq(self, seq: str) -> tuple[str, _Seq]:
        stream = self._stream
        if self._closing:
            raise EngineError("the engine is closed")
        if self._state != "up" or stream is None or stream.closed:
            raise EngineUnavailable(self._error or f"node {self.node_id} is not connected "
                                    "yet", retry_after_s=self.retry_after_s)
        if seq in self._seqs:
            raise EngineError(f"sequence {seq} is already in flight to node {self.node_id}")
        sequence = _Seq(stream)
        self._seqs[seq] = sequence
        return seq, sequence

    async def _send(self, sequence: _Seq, message: m.Sequence,
                    request: GenerationRequest) -> None:
        prompt = list(request.prompt_tokens)
        try:
            await sequence.stream.send(encode_envelope(
                message.to_wire(),
                [("prompt", "i32", (1, len(prompt)), struct.pack(f"<{len(prompt)}i",
                                                                 *prompt))]))
        except ConnectionClosed as exc:
            self._seqs.pop(message.seq, None)
            raise EngineUnavailable(f"node {self.node_id}: sending failed ({exc.kind})",
                                    retry_after_s=self.retry_after_s) from exc

    async def _tokens(self, seq: str, sequence: _Seq, request: GenerationRequest
                      ) -> AsyncGenerator[TokenOutput, None]:
        finished = False
        try:
            while not finished:
                item = await sequence.inbox.get()
                if isinstance(item, BaseException):
                    raise item
                if item.type == "error":
                    raise self._refused(error_in(item))
                out = token_output(self.node_id, item, request.params.logprobs)
                finished = out.finish_reason is not None
                yield out
        finally:
            self._end(seq, sequence, cancel=not finished)

    async def _cancel(self, stream: MxclStream, seq: str) -> None:
        with contextlib.suppress(ConnectionClosed):
            await stream.send(encode_envelope(m.Cancel(seq).to_wire()))
        self._finish_if_done(stream)

    def _refused(self, error: CodedError) -> Exception:
        """The node's ``error`` as ``answers.refusal`` says; a ``draining`` one also passes
        the node over until ``draining_until``."""
        if error.code == p.ERR_DRAINING:
            self.draining_until = asyncio.get_running_loop().time() + DRAINING_RETRY_S
        return refusal(self.node_id, error)

    async def aclose(self) -> None:
        self._closing = True
        self._wake.set()
        streams = list(self._streams)  # a handed-over one finishing included
        await self._tasks.aclose()
        for stream in streams:
            await stream.close("router stopping")

