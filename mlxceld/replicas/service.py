"""A serving node's side of the replica wire: its engine, served to the cluster's routers.

``ServingService`` serves any ``Engine`` (a hybrid node's local engine, or its own
pipeline) on an MXCL listener, channel 1, at ``address`` (port 0: an ephemeral
port, ``port`` once bound). The messages and their rules are ``protocol.py``'s.

- Any identity that completes the handshake under the cluster secret may attach;
  ``attach`` must name this node's model identity and cluster, else ``error``
  ``model_mismatch`` / ``cluster_mismatch`` and the connection is closed.
- Each ``generate`` runs on the engine as an ordinary sequence, batched with the
  node's own OpenAI clients' sequences, in a task of the service's; its tokens go back
  over its connection as they come. A sequence belongs to its connection
  (``protocol.py``): a ``cancel`` from another is ignored.
- Handover (``adopt``, a router's secret rotation): another connection of the same
  router adopts a sequence; ``adopted`` goes over the old connection after everything
  the sequence sent there, and its next tokens over the new one, so a sequence of any
  length leaves the old key's connection, which its router then finishes.
- A connection that ends (closed, reset, or silent: nothing heard for
  ``silence_s``, its heartbeat ``net/liveness.py``) has the sequences that belong to it
  cancelled in the engine at once: nothing keeps running for a router that is gone.
- Bounds: at most ``max_sequences`` sequences in flight on one connection (default
  the engine's ``max_batch``, at most ``protocol.MAX_SEQUENCES``), and the node's
  engine at most ``max_batch`` running plus as many again waiting: beyond either,
  ``busy`` (the router tries another node). A prompt over the engine's context
  length is ``bad_request``, as is a token id outside the model's vocabulary
  (``vocab_size``: checked before the engine sees it). While draining (``finish_held``, as
  the node stops) every ``generate`` is refused with ``draining`` and the sequences
  held run to their end, for a bound the caller gives.
- An operator's drain (``drain``: `mlxctl drain` of this node, said by the daemon through
  the worker's ``drain`` op) refuses every new sequence with ``draining`` too (a router
  tries another member before the first token), lets the held ones run, and at its
  deadline ends the rest, each with an ``error`` ``draining`` (its router's client gets
  the error); ``undrain`` admits again. ``drain_state`` says what it holds: sequences in
  flight, finished and ended since the drain began, and who still sends work (each
  attached router with sequences in flight: its identity and count).
- Engine failures map to codes: a constraint it cannot use (``ConstraintError``) is
  ``bad_request``; ``EngineUnavailable`` (a stage of the node's own pipeline down)
  is ``unavailable``; any other ``EngineError`` is ``internal``.

- Its load (``load``: the engine's sequences, its own clients' included) goes to each
  attached router at once and then every ``protocol.LOAD_EVERY_S`` while it changed.

Pings are answered by the stream itself (PROTOCOL.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from mlxceld.engine.base import (
    Engine,
    EngineError,
    EngineUnavailable,
    GenerationRequest,
    TokenOutput,
)
from mlxceld.engine.constraints import ConstraintError
from mlxceld.net import ConnectionClosed, Listener, MxclStream
from mlxceld.net.liveness import watch
from mlxceld.replicas import protocol as p
from mlxceld.replicas.messages import Adopt, Adopted, Attached, Cancel, Generate, Load, Sequence
from mlxceld.replicas.serving_drain import OperatorDrain
from mlxceld.tasks import Background, cancelling_group
from mlxceld.wire import (
    Envelope,
    EnvelopeError,
    MessageSpec,
    SecretStore,
    encode_envelope,
    parse_envelope,
)
from mlxceld.wire.address import parse_address
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import Attach, CodedError, Token

log = logging.getLogger(__name__)


@dataclass(eq=False)  # hashable by identity: the service's set of links
class _Link:
    """One router's connection: the sequences that belong to it, by ``seq``."""

    stream: MxclStream
    attached: bool = False
    reporting: bool = False  # its ``load`` task runs
    seqs: dict[str, _Sequence] = field(default_factory=dict)


@dataclass(eq=False)
class _Sequence:
    """One sequence of a router: the connection it belongs to (the one that sent it, or
    the one that adopted it since: its answers go there) and its task."""

    link: _Link
    task: asyncio.Task[None] = field(init=False)


class ServingService:
    def __init__(self, engine: Engine, *, node_id: str, role: str, model_identity: str,
                 cluster: str, keyring: SecretStore, address: str, silence_s: float,
                 max_sequences: int | None = None, vocab_size: int | None = None) -> None:
        """``address``: where to listen, ``host:port`` (port 0: ephemeral);
        ``silence_s``: how long a router may send nothing before its connection is
        dropped; ``max_sequences``: sequences in flight per connection (see above);
        ``vocab_size``: the model's, every prompt token id must be below it (None: the
        engine checks them itself, as a pipeline's first stage does)."""
        where = parse_address(address, port_zero=True)
        self.engine = engine
        self.node_id = node_id
        self.role = role
        self._model_identity = model_identity
        self._cluster = cluster
        self._silence_s = silence_s
        self._vocab_size = vocab_size
        self._keyring = keyring
        limit = engine.max_batch if max_sequences is None else max_sequences
        self.max_sequences = max(1, min(limit, p.MAX_SEQUENCES))
        self.draining = False  # stopping (``finish_held``): no new sequence, for good
        self._drain = OperatorDrain(node_id)  # `mlxctl drain` of this node (``drain``)
        self._links: set[_Link] = set()  # every connection's, while it lasts
        # The sequences' tasks: each ends with the connection it belongs to, which may be
        # another than the one that started it (``adopt``); aclose ends any left.
        self._sequences = Background(f"the sequences of node {node_id}")
        self._cut: set[asyncio.Task[Any]] = set()  # sequences the drain's deadline cancelled
        self._held = 0  # sequences in flight over all connections
        self._ended = asyncio.Event()  # set as each sequence ends (``finish_held`` waits on it)
        self._specs: dict[str, MessageSpec] = dict(p.NODE_SPECS)
        self._unattached: frozenset[str] = frozenset()  # types a peer sends unattached
        self._listener = Listener(where.host, where.port, keyring=keyring,
                                  identity_of_server=address, channels={1},
                                  handler=self._handle, name=f"serving listener of {node_id}")

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def host(self) -> str:
        return self._listener.host

    @property
    def sequences(self) -> int:
        """Sequences in flight for routers."""
        return self._held

    async def start(self) -> None:
        """Bind (``port`` is known after this); ``OSError`` if the port is taken."""
        await self._listener.start()

    async def serve(self, started: asyncio.Future[None] | None = None) -> None:
        """Accept and serve until ``aclose``; ``started`` resolves once it accepts."""
        log.info("serving node %s (%s) serves its engine to routers on %s:%d", self.node_id,
                 self.role, self.host, self.port)
        await self._listener.serve(started)

    async def finish_held(self, within_s: float) -> int:
        """Take no new sequence (``draining``) and wait for those held to end, at most
        ``within_s``; how many are still held then (``aclose`` cancels them)."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                while self._held:
                    self._ended.clear()
                    await self._ended.wait()
        return self._held

    async def aclose(self) -> None:
        """Stop accepting; every connection ends and its sequences are cancelled."""
        self._drain.disarm()
        await self._listener.aclose()
        await self._sequences.aclose()

    # -- an operator's drain ------------------------------------------------------------

    def drain(self, deadline: float | None) -> None:
        """Refuse new sequences (``draining``) until ``undrain``; at ``deadline`` (unix s;
        None: none) end those still held. Said again with the same deadline: nothing
        changes; with another: the timer follows it."""
        self._drain.begin(deadline, self._deadline)

    def undrain(self) -> None:
        """Admit new sequences again (unless the node stops)."""
        self._drain.end()

    def drain_state(self) -> dict[str, Any]:
        """``in_flight`` (sequences held), ``finished`` and ``ended`` (at the deadline)
        since the drain began, and ``senders``: each router with sequences held here."""
        d = self._drain
        senders = sorted(({"router": link.stream.peer_identity, "sequences": len(link.seqs)}
                          for link in self._links if link.seqs),
                         key=lambda s: str(s["router"]))
        admitted = sum(len(link.seqs) for link in self._links)  # some not started yet
        return {"in_flight": max(self._held, admitted), "finished": d.left - d.ended,
                "ended": d.ended, "senders": senders}

    def _deadline(self) -> None:
        """The drain's deadline: every sequence still held ends with ``draining``."""
        held = [s.task for link in self._links for s in link.seqs.values()]
        if held:
            log.warning("drain of node %s reached its deadline: ending %d sequence(s) of "
                        "routers", self.node_id, len(held))
        for task in held:
            self._cut.add(task)
            task.cancel()

    async def _cuttable(self, sequence: _Sequence, seq: str, work: Awaitable[None]) -> None:
        """Run one sequence's ``work``; cancelled by the drain's deadline, tell its router
        (``draining``) and end quietly; any other cancellation goes on."""
        d = self._drain
        task = asyncio.current_task()
        try:
            await work
        except asyncio.CancelledError:
            if task is None or task not in self._cut or task.uncancel() != 0:
                raise
            d.ended += 1
            message = (f"node {self.node_id} is draining and its drain reached its deadline "
                       "before the sequence finished")
            with contextlib.suppress(ConnectionClosed):
                await sequence.link.stream.send(encode_envelope(
                    CodedError(p.ERR_DRAINING, message, seq).to_wire()))
        finally:
            if task is not None:
                self._cut.discard(task)
            if d.active:
                d.left += 1

    def _spawn(self, link: _Link, seq: str,
               work_of: Callable[[_Sequence], Coroutine[Any, Any, None]]) -> None:
        """Run ``seq``'s work (``work_of`` it) in a task of the service's, as one of
        ``link``'s sequences: it ends with the connection it belongs to then."""
        sequence = _Sequence(link)
        work = work_of(sequence)
        task = self._sequences.spawn(self._cuttable(sequence, seq, work))

        def done(_: asyncio.Task[None]) -> None:
            # A task cancelled before its first step (a ``cancel`` right behind its
            # ``generate``, its connection ended at once) never runs ``work``: close it,
            # and let the sequence go from its link's, as ``work`` would have.
            work.close()
            _forget(sequence, seq)

        task.add_done_callback(done)
        sequence.task = task
        link.seqs[seq] = sequence

    async def _adopt(self, link: _Link, seq: str) -> None:
        """``seq`` belongs to ``link`` from now on, if it belongs to another connection of
        the same router (its identity, the handshake's); ``adopted`` goes over that one,
        after all the sequence sent there (a message is sealed in order as ``send`` is
        called), and the sequence's next answers go over ``link``."""
        router = link.stream.peer_identity
        old = next((other for other in self._links if other is not link and router
                    is not None and other.stream.peer_identity == router
                    and seq in other.seqs), None)
        if old is None or seq in link.seqs:
            return  # ended meanwhile, another router's, or here already: nothing moves
        sequence = old.seqs.pop(seq)
        sequence.link = link
        link.seqs[seq] = sequence
        log.debug("node %s: sequence %s of router %s moved to its connection under key %s",
                  self.node_id, seq, router, link.stream.key_id.hex())
        with contextlib.suppress(ConnectionClosed):
            await old.stream.send(encode_envelope(Adopted(seq).to_wire()))

    # -- one connection -----------------------------------------------------------------

    async def _handle(self, stream: MxclStream) -> None:
        link = _Link(stream)
        ended = "connection ended"
        self._links.add(link)
        try:
            async with cancelling_group() as tg:
                # The heartbeat ends the stream of a silent router (recv then raises); it
                # ends with the connection, as the sequences that belong to it do.
                tg.create_task(watch(stream, self._silence_s,
                                     f"router {stream.peer} of {self.node_id}"))
                ended = await self._serve_link(link, tg)
        finally:
            self._links.discard(link)
            if link.seqs:
                log.info("cancelled %d sequence(s) of router %s (%s)", len(link.seqs),
                         stream.peer, ended)
                tasks = [s.task for s in link.seqs.values()]
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks)

    async def _serve_link(self, link: _Link, tg: asyncio.TaskGroup) -> str:
        """Read the router's messages until its connection ends; why it ended."""
        stream = link.stream
        while True:
            try:
                payload = await stream.recv()
            except ConnectionClosed as exc:
                return str(exc)
            try:
                env = parse_envelope(payload, self._specs)
            except EnvelopeError as exc:
                await self._refuse(link, None, p.ERR_BAD_MESSAGE, f"bad message: {exc.reason}")
                continue
            seq = env.header.get("seq") if isinstance(env.header.get("seq"), str) else None
            try:
                if env.type == "attach":
                    if not await self._attach(link, env):
                        return "refused to attach"
                    if not link.reporting:
                        link.reporting = True
                        tg.create_task(self._report_load(link))
                elif env.type in self._unattached:
                    await self._other(link, env)
                elif not link.attached:
                    raise p.ProtocolViolation(p.ERR_BAD_MESSAGE,
                                              "send 'attach' before any other message")
                elif env.type == "generate":
                    self._generate(link, env)
                elif env.type == "cancel":
                    sequence = link.seqs.get(Cancel.from_wire(env.header).seq)
                    if sequence is not None:
                        sequence.task.cancel()
                elif env.type == "adopt":
                    await self._adopt(link, Adopt.from_wire(env.header).seq)
                else:
                    await self._other(link, env)
            except p.ProtocolViolation as exc:
                await self._refuse(link, seq, exc.code, exc.message)
            except MessageError as exc:  # the replica protocol's words for a bad field
                await self._refuse(link, seq, p.ERR_BAD_MESSAGE, exc.reason)

    async def _other(self, link: _Link, env: Envelope) -> None:
        """A message this node's role does not take (a subclass's role may)."""
        raise p.ProtocolViolation(p.ERR_BAD_MESSAGE, f"node {self.node_id} is a {self.role} "
                                  f"node: it takes no '{env.type}'")

    async def _report_load(self, link: _Link) -> None:
        """``load`` now, then every ``LOAD_EVERY_S`` while it changed (see above)."""
        said: tuple[int, int] | None = None
        with contextlib.suppress(ConnectionClosed):
            while True:
                load = (self.engine.active_sequences(), self.engine.max_batch)
                if load != said:
                    await link.stream.send(encode_envelope(Load(*load).to_wire()))
                    said = load
                await asyncio.sleep(p.LOAD_EVERY_S)

    async def _refuse(self, link: _Link, seq: str | None, code: str, message: str) -> None:
        log.warning("refused a message of router %s: %s (%s)", link.stream.peer, message,
                    code)
        with contextlib.suppress(ConnectionClosed):
            await link.stream.send(encode_envelope(CodedError(code, message, seq).to_wire()))

    async def _attach(self, link: _Link, env: Envelope) -> bool:
        attach = Attach.from_wire(env.header)
        model, cluster = attach.model, attach.cluster
        code, message = None, ""
        if model != self._model_identity:
            code = p.ERR_MODEL_MISMATCH
            message = (f"node {self.node_id} serves model {self._model_identity}, the router "
                       f"asked for model {model}: give both the same checkpoint")
        elif cluster != self._cluster:
            code = p.ERR_CLUSTER_MISMATCH
            message = (f"node {self.node_id} is in cluster {self._cluster!r}, the router in "
                       f"{cluster!r}: give both the same cluster config")
        if code is not None:
            log.error("%s (router %s)", message, link.stream.peer)
            with contextlib.suppress(ConnectionClosed):
                await link.stream.send(encode_envelope(CodedError(code, message).to_wire()))
            await link.stream.close(code.replace("_", " "))
            return False
        engine = self.engine
        await link.stream.send(encode_envelope(Attached(
            self.node_id, self.role, self._model_identity, engine.context_length,
            engine.max_batch).to_wire()))
        if not link.attached:
            log.info("router %s attached to node %s", link.stream.peer, self.node_id)
        link.attached = True
        return True

    def _generate(self, link: _Link, env: Envelope) -> None:
        seq, request = self._admit(link, Generate.from_wire(env.header), env)
        self._spawn(link, seq, lambda sequence: self._run(sequence, seq, request))

    def _admit(self, link: _Link, message: Sequence, env: Envelope
               ) -> tuple[str, GenerationRequest]:
        """A ``generate``-like message's sequence (its prompt: ``env``'s tensor), checked
        against this node's bounds."""
        seq, params = message.seq, message.params
        if seq in link.seqs:
            raise p.ProtocolViolation(p.ERR_BAD_MESSAGE, f"sequence {seq} is already running "
                                      "on this connection")
        prompt = env.tensors["prompt"]
        n = prompt.shape[1]
        engine = self.engine
        if n > engine.context_length:
            raise p.ProtocolViolation(p.ERR_BAD_REQUEST, f"the prompt is {n} tokens; node "
                                      f"{self.node_id}'s context is {engine.context_length}")
        if self.draining or self._drain.active:
            why = "stopping" if self.draining else "draining (mlxctl drain)"
            raise p.ProtocolViolation(p.ERR_DRAINING, f"node {self.node_id} is {why}: it "
                                      "finishes its sequences and takes no new one")
        if len(link.seqs) >= self.max_sequences:
            raise p.ProtocolViolation(p.ERR_BUSY, f"node {self.node_id} holds this router's "
                                      f"bound of {self.max_sequences} sequences")
        if engine.active_sequences() >= 2 * engine.max_batch:
            raise p.ProtocolViolation(p.ERR_BUSY, f"node {self.node_id} is full "
                                      f"({engine.active_sequences()} sequences)")
        tokens = struct.unpack(f"<{n}i", prompt.data)
        if self._vocab_size is not None and not 0 <= min(tokens) <= max(tokens) \
                < self._vocab_size:
            raise p.ProtocolViolation(p.ERR_BAD_REQUEST, "prompt token ids must be in [0, "
                                      f"{self._vocab_size}) (node {self.node_id}'s model)")
        return seq, GenerationRequest(f"replica-{seq}", tokens, params)

    async def _run(self, sequence: _Sequence, seq: str, request: GenerationRequest,
                   tokens_of: Callable[[], AsyncGenerator[TokenOutput, None]] | None = None
                   ) -> None:
        """One sequence: its tokens to its router (over the connection it belongs to as
        each is sent), or one ``error``; cancelled with that connection or by ``cancel``.
        ``tokens_of``: where its tokens come from (default: the engine's ``generate``)."""
        self._held += 1
        try:
            source = self.engine.generate(request) if tokens_of is None else tokens_of()
            async with contextlib.aclosing(source) as tokens:
                async for out in tokens:
                    await sequence.link.stream.send(encode_envelope(
                        _token(seq, out, request.params.logprobs),
                        [("tokens", "i32", (1,), struct.pack("<i", out.token))]))
        except ConnectionClosed:
            pass  # the connection's end cancels the rest
        except (ConstraintError, EngineError) as exc:
            await self._failed(sequence.link, seq, exc)
        finally:
            self._held -= 1
            self._ended.set()
            _forget(sequence, seq)

    async def _failed(self, link: _Link, seq: str, exc: Exception) -> None:
        if isinstance(exc, ConstraintError):
            code = p.ERR_BAD_REQUEST
        elif isinstance(exc, EngineUnavailable):
            code = p.ERR_UNAVAILABLE
        else:
            code = p.ERR_INTERNAL
            log.warning("node %s: sequence %s of router %s failed: %s", self.node_id, seq,
                        link.stream.peer, exc)
        error = CodedError(code, str(exc), seq, retry_after_s=exc.retry_after_s
                           if isinstance(exc, EngineUnavailable) else None)
        with contextlib.suppress(ConnectionClosed):
            await link.stream.send(encode_envelope(error.to_wire()))


def _forget(sequence: _Sequence, seq: str) -> None:
    """``seq`` ended: it belongs to no connection any more."""
    if sequence.link.seqs.get(seq) is sequence:
        del sequence.link.seqs[seq]


def _token(seq: str, out: TokenOutput, logprobs: int | None) -> dict[str, Any]:
    """A ``token`` message's header for ``out`` (its tensor carries the token id): with
    its log-probabilities when the request asked for them."""
    asked = logprobs is not None
    return Token(seq, None, out.logprob if asked else None, tuple(out.top) if asked else None,
                 out.finish_reason, out.cached).to_wire()
