"""A pipeline stage's service: sequences, authorization, compute, forwarding.

Runs in the ``stage`` worker behind an MXCL listener on channel 1 (see
``protocol`` for the messages and the authorization rules). The stage's layers
run one group of steps at a time (``compute.next_groups``, run by ``steps.py``, which
also sends each result on); the asyncio side here parses, authorizes and enqueues. A
step runs on the compute thread, except a decode step (one token per sequence) while the
last one took under ``steps.INLINE_STEP_S``: that runs on the event loop's own thread,
since handing it to the compute thread and back costs two thread wake-ups, a large share
of a short step (bench: +24% tok/s on the tiny fixture, no change on small), and holding
the loop for so short a time delays nothing that matters. Prefill chunks always go to
the compute thread, so the loop keeps answering while a long prompt runs.

Every router of the pipeline (its coordinator, and any other daemon with the cluster
secret that follows its plan: ``protocol.py``'s authorization) prepares and runs
sequences of its own; each owns what it prepared and keeps its own prompt-cache entries
(``kvstore.StageCache``, by the router's identity).

Each sequence keeps its own KV cache until it is released, its owner's
connection closes, or the stage stops. Every accepted connection has a heartbeat
(``silence_s``, ``mlxceld.net.liveness.watch``): a router (or upstream stage) that
sends nothing, not even a pong to the stage's pings, for ``silence_s`` (stopped,
asleep, off the network: no RST ever comes) has its connection dropped and its
sequences freed at once, logged with the reason; the router re-dials and prepares
afresh as after any lost link. Its owner may move a sequence to another of its
connections (``adopt``: a handover to a new key, ``links.py``): ``adopted`` goes
over the old one, after all the sequence's messages there, and the rest over the new.
The last stage continues each sequence it samples for: it sends the token to
the owner and, unless the token ends the sequence or ``max_tokens`` are reached,
to the first stage as the next step (``next``), so decode steps go round the
stages without the coordinator (the connections onward: ``onward.py``). A constrained
sequence (``params.constraint``) gets a matcher on the last stage (``matching.py``),
whose tokenizer it reads from the model's directory at its first such ``prepare``; a
constraint it cannot use is refused (``bad_constraint``).

The prompt cache (``kvstore.py``; the router decides, ``prefixes.py``): ``release`` with
``keep``, ``prepare`` with ``keep_prompt`` or ``reuse``. A tensor-parallel stage keeps
one as any stage: rank 0's store is the journal's source of every change, which its
other ranks mirror (``tensor_stage.py``, ``kvmirror.py``).

Progress, for the supervisor's watchdog: ``stats.steps``, ``stats.last_step_at`` and
``busy_since`` (while steps are queued): a hung compute, or a forward stuck on a stalled
next stage, stays busy with no new step.

Bounds: ``MAX_SEQUENCES`` prepared at once; the connections to the next and the first
stage are dialed, watched by a heartbeat and bounded in each send, and handed over to
the new primary key on a ``rekey``, as ``onward.py`` says: a send that fails tells the
sequence's owner ``downstream_unreachable`` instead of holding this stage's loop.

Draining (``finish_held``, when the worker is told to stop: SIGTERM): the stage refuses
every new ``prepare`` with ``draining`` (the router answers 503 naming the stage)
and keeps serving the sequences it holds, until each is released (or its owner's
connection ends), for at most ``DRAIN_S``; then the worker closes. ``DRAIN_S`` stays
under the stop timeout of a model worker (``roster.MODEL_STOP_TIMEOUT_S``: 20 s), so
the supervisor's SIGKILL never cuts a drain short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from mlxceld.engine.base import EngineError
from mlxceld.net import ConnectionClosed, MxclStream
from mlxceld.net.liveness import watch
from mlxceld.net.resolve import Resolver
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.compute import DraftClock, SeqState, StageModelLike
from mlxceld.pipeline.kvstore import StageCache
from mlxceld.pipeline.matching import StageMatching
from mlxceld.pipeline.messages import (
    Act,
    Adopted,
    Attached,
    Forget,
    Next,
    Prepare,
    Prepared,
    Release,
    Run,
)
from mlxceld.pipeline.onward import Onward
from mlxceld.pipeline.sequences import (
    Keep,
    StagePlace,
    StageSequence,
    StageStats,
    stage_cache,
)
from mlxceld.pipeline.steps import StageSteps, send_quietly
from mlxceld.tasks import scoped_group
from mlxceld.types import DEFAULT_SILENCE_S
from mlxceld.wire import (
    Envelope,
    EnvelopeError,
    Keyring,
    encode_envelope,
    parse_envelope,
)
from mlxceld.wire.address import bound_identity, parse_address
from mlxceld.wire.messages import MessageError
from mlxceld.wire.transport_messages import Attach, CodedError, seq_field

if TYPE_CHECKING:  # mlx: imported by the stage worker only, never by the daemon
    from mlxceld.engine.speculative import Draft
    from mlxceld.pipeline.tensor_stage import StageLeader

log = logging.getLogger(__name__)

# What other stages send: the tensor it carries, and the refusal when the sender is not
# the one stage allowed to send it (act: the upstream stage; next: the last stage).
_FROM_STAGES: Final = {
    "act": ("hidden", p.ERR_NOT_UPSTREAM, "activations are accepted only from the upstream "
            "stage"),
    "next": ("tokens", p.ERR_NOT_LAST, "'next' is accepted only from the last stage"),
}
DRAIN_S: Final = 15.0  # how long a stopping stage serves the sequences it holds (see above)


@dataclass(frozen=True)
class _Sender:
    """Who is at the other end of a connection, and which of the stage's peers it is."""

    who: str
    upstream: bool
    last: bool

    @property
    def router(self) -> bool:
        """Whether it may send commands: any identity the handshake bound under the
        cluster's keyring but this stage's own neighbours (``protocol.py``)."""
        return not (self.upstream or self.last)


class StageService:
    def __init__(self, model: StageModelLike, place: StagePlace, keyring: Keyring,
                 wire_dtype: str, *, standby: bool = False,
                 silence_s: float = DEFAULT_SILENCE_S,
                 tokenizer_path: Path | None = None, cache_bytes: int = 0,
                 leader: StageLeader | None = None, draft: Draft | None = None) -> None:
        """``tokenizer_path``: the model's directory, whose tokenizer the last stage reads
        to decode under a constraint (None: a constrained ``prepare`` is refused);
        ``cache_bytes``: the prompt cache's bound unless the router names one;
        ``leader``: a tensor-parallel stage's rank 0 (``tensor_stage.py``): each sequence
        opened on it at ``prepare`` (naming the prompt-cache entry it starts from) and
        dropped when forgotten, its steps run by it, and told each change to the prompt
        cache (its store's journal), so that its other ranks mirror it;
        ``draft``: on the last stage, the draft its sequences speculate with
        (``speculating.py``; its counters in the stage's stats)."""
        self.draft = draft
        self.draft_clock = DraftClock()  # its time in the draft (speculating.py)
        self._model = model
        self._matching = StageMatching(place.node_id, tokenizer_path, model.vocab_size)
        self._place = place
        self._specs = p.stage_specs(model.hidden_size, wire_dtype, first=model.first)
        self._seqs: dict[str, StageSequence] = {}
        self._leader = leader
        self.cache = StageCache(place.node_id, cache_bytes,
                                journal=leader)  # the prompt cache (kvstore.py)
        self._onward = Onward(place.node_id, keyring, parse_address(place.address),
                              place.downstream, place.first, silence_s)
        self._silence_s = silence_s
        self._resolver = Resolver()  # the configured peers' host names
        self.standby = standby  # prepared by a two-phase assignment, not yet activated
        self.stats = StageStats()
        self._steps = StageSteps(model, place.node_id, self._seqs, self.cache, self._onward,
                                 self.stats, self._forget, leader)
        self.draining = False  # stopping: no new sequence (``finish_held``)
        self._loop: asyncio.AbstractEventLoop | None = None  # run's (``group_broke``)
        self._released = asyncio.Event()  # set when a sequence is forgotten (``finish_held``)

    def activate(self) -> None:
        """Leave standby: the weights are loaded already, so this is only a switch."""
        if self.standby:
            self.standby = False
            log.info("stage %s is active", self._place.node_id)

    @property
    def sequences(self) -> int:
        return len(self._seqs)

    @property
    def queued(self) -> int:
        """Steps enqueued and not yet run: the stage's queue depth."""
        return self._steps.queued

    @property
    def busy_since(self) -> float | None:
        """``time.monotonic()`` when steps were last queued after none; None while idle."""
        return self._steps.busy_since

    def links_rtt_ms(self) -> dict[str, float | None]:
        """Its connections onward and their latest round trips (``Onward.rtts_ms``)."""
        return self._onward.rtts_ms()

    async def finish_held(self, deadline: float) -> int:
        """Refuse new sequences and wait until those held are released, at the latest
        until ``deadline`` (the loop's clock); the number still held then."""
        self.draining = True
        held = len(self._seqs)
        log.info("stage %s draining: %d sequence(s) to finish within %.0f s",
                 self._place.node_id, held, max(0.0, deadline - asyncio.get_running_loop()
                                                .time()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                while self._seqs:
                    self._released.clear()
                    await self._released.wait()
        left = len(self._seqs)
        if left:
            log.warning("stage %s: %d sequence(s) still running at the drain's deadline "
                        "are dropped", self._place.node_id, left)
        elif held:
            log.info("stage %s drained: its %d sequence(s) finished", self._place.node_id,
                     held)
        return left

    def rekey(self) -> None:
        """The keyring's primary changed: the connections to the next and the first stage
        are handed over to streams under it, in the background (``Onward.rekey``)."""
        self._onward.rekey()

    def _forget(self, seq_id: str, *, kept: bool = False) -> None:
        """The sequence's cache is freed (released, failed, its owner gone); ``kept``: it
        goes into the prompt cache first (a release with ``keep``)."""
        if self._seqs.pop(seq_id, None) is not None:
            if self._leader is not None:  # and its followers' at the next share (parked
                self._leader.drop(seq_id, park=kept)  # until that put: tensor_stage.py)
            self._released.set()

    def group_broke(self, why: str) -> None:
        """A tensor-parallel stage's group broke (told on its watchdog's thread, before
        this process ends): each sequence's owner is told, naming why."""
        loop, seqs = self._loop, list(self._seqs.items())
        if loop is None or loop.is_closed():
            return
        message = (f"stage {self._place.node_id}'s tensor-parallel group broke: {why}; "
                   "the daemon restarts the group")
        log.error("%s; %d sequence(s) fail", message, len(seqs))
        for seq_id, seq in seqs:
            asyncio.run_coroutine_threadsafe(send_quietly(seq.stream, encode_envelope(
                CodedError(p.ERR_GROUP_BROKEN, message, seq_id).to_wire())), loop)

    # -- connections --------------------------------------------------------------------

    async def handle(self, stream: MxclStream) -> None:
        """Serve one authenticated connection (the listener's handler)."""
        bound = bound_identity(stream.peer_identity, stream.peer)
        is_node = self._resolver.is_node
        sender = _Sender(str(bound), await is_node(self._place.upstream, bound),
                         await is_node(self._place.last, bound))
        ended = "connection ended"
        try:
            async with scoped_group() as tg:
                # The heartbeat ends the stream of a silent peer (recv then raises); it
                # ends with the connection.
                tg.create_task(watch(stream, self._silence_s,
                                     f"stage {self._place.node_id}'s peer {sender.who}"))
                await self._serve(stream, sender)
        except ConnectionClosed as exc:
            ended = str(exc)  # "connection closed (silent): nothing heard for ..."
        finally:
            self._forget_connection(stream, ended)

    async def _serve(self, stream: MxclStream, sender: _Sender) -> None:
        """Read the connection's messages and act on each, until it ends (or a refused
        ``attach`` ends it)."""
        attached = False
        while True:
            payload = await stream.recv()
            try:
                env = parse_envelope(payload, self._specs)
            except EnvelopeError as exc:
                await self._refuse(stream, p.ProtocolViolation(
                    p.ERR_BAD_MESSAGE, f"bad message: {exc.reason}"), None)
                continue
            try:
                if env.type in _FROM_STAGES:
                    self._from_stage(env, sender)
                    continue
                if not sender.router:
                    raise p.ProtocolViolation(
                        p.ERR_NOT_COORDINATOR, f"commands are accepted only from routers; "
                        f"you are {sender.who}, a stage of this pipeline")
                if env.type == "attach":
                    if not await self._attach(stream, sender.who, env):
                        return
                    attached = True
                elif not attached:
                    raise p.ProtocolViolation(p.ERR_BAD_MESSAGE,
                                              "send 'attach' before any other command")
                else:
                    await self._command(stream, sender.who, env)
            except p.ProtocolViolation as exc:
                await self._refuse(stream, exc, env)
            except MessageError as exc:  # the stage protocol's words for a bad field
                await self._refuse(stream, p.ProtocolViolation(p.ERR_BAD_MESSAGE, exc.reason),
                                   env)

    async def _refuse(self, stream: MxclStream, exc: p.ProtocolViolation,
                      env: Envelope | None) -> None:
        self.stats.refused += 1
        header = env.header if env is not None else {}
        seq = header.get("seq") if isinstance(header.get("seq"), str) else None
        step = header.get("step") if type(header.get("step")) is int else None
        log.warning("refused %s from %s: %s", env.type if env else "a message", stream.peer,
                    exc.message)
        await send_quietly(stream, encode_envelope(
            CodedError(exc.code, exc.message, seq, step).to_wire()))

    def _forget_connection(self, stream: MxclStream, why: str) -> None:
        """Sequences whose owner's connection ended are released: nobody can use them."""
        gone = [s for s, seq in self._seqs.items() if seq.stream is stream]
        for s in gone:
            self._forget(s)
        if gone:
            log.info("released %d sequences of %s (%s)", len(gone), stream.peer, why)

    # -- commands -----------------------------------------------------------------------

    async def _attach(self, stream: MxclStream, who: str, env: Envelope) -> bool:
        place = self._place
        if self.standby:
            raise p.ProtocolViolation(p.ERR_STANDBY, f"stage {place.node_id} is prepared but "
                                      "not active yet (its assignment has not been activated)")
        attach = Attach.from_wire(env.header)
        theirs = attach.model
        if theirs != place.model_identity:
            message = (f"stage {place.node_id} serves model {place.model_identity}, the "
                       f"router {who} asked for model {theirs}: give both the same checkpoint")
            log.error("%s (router %s)", message, stream.peer)
            await send_quietly(stream, encode_envelope(
                CodedError(p.ERR_MODEL_MISMATCH, message).to_wire()))
            await stream.close("model mismatch")
            return False
        budget = self.cache.attached(who, attach)
        await stream.send(encode_envelope(Attached(
            place.node_id, place.rank, place.layers, place.model_identity, place.cluster,
            budget).to_wire()))
        return True

    async def _command(self, stream: MxclStream, who: str, env: Envelope) -> None:
        if env.type == "forget":
            await stream.send(encode_envelope(
                self.cache.forget(who, Forget.from_wire(env.header)).to_wire()))
            return
        seq_id = seq_field(env.header)
        current = self._seqs.get(seq_id)
        if current is not None and current.owner != who:
            raise p.ProtocolViolation(p.ERR_NOT_OWNER,
                                      f"sequence {seq_id} belongs to another identity")
        if env.type == "prepare":
            if self.draining:
                raise p.ProtocolViolation(p.ERR_DRAINING, f"stage {self._place.node_id} is "
                                          "stopping: it finishes its sequences and takes no "
                                          "new one; retry in a few seconds")
            last = self._model.last
            prepare = Prepare.from_wire(env.header, self._model.vocab_size if last else None)
            params, eos = prepare.params, frozenset(prepare.eos)
            if current is None and len(self._seqs) >= p.MAX_SEQUENCES:
                raise p.ProtocolViolation(p.ERR_TOO_MANY, f"stage {self._place.node_id} "
                                          f"already holds {p.MAX_SEQUENCES} sequences")
            state = SeqState(self._leader.caches(prepare.kv) if self._leader is not None
                             else stage_cache(self._model, prepare.kv, self._place.node_id),
                             None)
            if last:
                # mlx: only once serving
                from mlxceld.engine.processors import make_logits_processors
                from mlxceld.engine.sampling import make_sampler

                state = SeqState(state.cache, make_sampler(params, self._model.vocab_size),
                                 make_logits_processors(params, eos),
                                 list(prepare.history or ()), params.logprobs)
                state.matching = await self._matching.matcher(params, eos)
                if self.draft is not None and self.draft.takes(params,
                                                               state.matching is not None):
                    from mlxceld.pipeline.speculating import SpecState

                    state.spec = SpecState(self.draft, params, self._model.vocab_size, eos,
                                           clock=self.draft_clock, ahead=not self._model.first)
            state.reuse = self.cache.reuse(who, prepare.reuse)  # copied on the compute side
            if self._leader is not None:  # its followers make caches alike (tensor_stage.py)
                self._leader.drop(seq_id)  # prepared again: its old caches first
                try:
                    self._leader.open(seq_id, state, prepare.kv, None if state.reuse is None
                                      or prepare.reuse is None else (who, *prepare.reuse))
                except EngineError as exc:  # the group is closed or broke
                    raise p.ProtocolViolation(p.ERR_GROUP_BROKEN if isinstance(
                        exc, p.GroupBroken) else p.ERR_STAGE_FAILED, str(exc)) from None
            self._seqs[seq_id] = StageSequence(who, stream, state, params, eos,
                                               snapshot=prepare.keep_prompt)
            await stream.send(encode_envelope(Prepared(
                seq_id, 0 if state.reuse is None else state.reuse[1]).to_wire()))
        elif env.type == "release":
            keep = Release.from_wire(env.header).keep
            kept = keep is not None and current is not None
            if keep is not None and current is not None:
                self._steps.keep(Keep(seq_id, current, *keep))
            self._forget(seq_id, kept=kept)
        elif env.type == "adopt":
            if current is not None and current.stream is not stream:
                await send_quietly(current.stream, encode_envelope(
                    Adopted(seq_id).to_wire()))
                current.stream = stream  # what it sends from now on goes here
        elif env.type == "run":
            if current is None:
                raise p.ProtocolViolation(p.ERR_UNKNOWN_SEQ,
                                          f"sequence {seq_id} is not prepared here")
            run = Run.from_wire(env.header)
            self._steps.enqueue(seq_id, current, run.step, run.sample, env.tensors["tokens"])

    def _from_stage(self, env: Envelope, sender: _Sender) -> None:
        """An activation (``act``) or a continuation (``next``) from another stage, if
        ``sender`` is the one stage that may send it."""
        tensor, code, what = _FROM_STAGES[env.type]
        if not (sender.upstream if env.type == "act" else sender.last):
            expected = self._place.upstream if env.type == "act" else self._place.last
            raise p.ProtocolViolation(code, f"{what} {expected}; you are {sender.who}")
        seq_id = seq_field(env.header)
        seq = self._seqs.get(seq_id)
        if seq is None:  # released meanwhile, or never prepared: nothing to correlate
            log.debug("dropped %s for unknown sequence %s", env.type, seq_id)
            return
        if env.type == "act":
            act = Act.from_wire(env.header)
            step, sample, pos = act.step, act.sample, act.pos
        else:
            nxt = Next.from_wire(env.header)
            step, sample, pos = nxt.step, True, nxt.pos
        self._steps.enqueue(seq_id, seq, step, sample, env.tensors[tensor], pos=pos,
                            ids=env.tensors.get("tokens") if env.type == "act" else None)

    async def run(self) -> None:
        """Run the queued steps (``steps.py``); meanwhile read the connections to the next
        and the first stage. Runs until cancelled."""
        self._loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._onward.run())
            await self._steps.run()

    async def aclose(self) -> None:
        await self._onward.aclose("stage stopping")
        self._seqs.clear()
        self.cache.clear()
        self._released.set()
