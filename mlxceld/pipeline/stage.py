"""A pipeline stage's service: sequences, authorization, compute, forwarding.

Runs in the ``stage`` worker behind an MXCL listener on channel 1 (see
``protocol`` for the messages and the authorization rules). One compute thread
runs the stage's layers, one step at a time in arrival order; the asyncio side
parses, authorizes and forwards, and never touches mlx arrays' values.

Each sequence keeps its own KV cache until it is released, its owner's
connection closes, or the stage stops. Bounds: ``MAX_SEQUENCES`` prepared at
once; a downstream stage is dialed within ``DOWNSTREAM_DIAL_S`` (then the
owner is told ``downstream_unreachable``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import struct
from dataclasses import dataclass
from typing import Any, Final

from mlxceld.engine.base import SamplingParams
from mlxceld.net import ConnectionClosed, MxclStream, connect
from mlxceld.net.errors import NetError
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.compute import SeqState, StageModelLike, Step, plan, run_group
from mlxceld.pipeline.peers import bound_identity, identity_matches
from mlxceld.wire import (
    Envelope,
    EnvelopeError,
    Keyring,
    encode_envelope,
    parse_envelope,
)

log = logging.getLogger(__name__)

DOWNSTREAM_DIAL_S: Final = 5.0


@dataclass(frozen=True)
class StagePlace:
    """Where this stage sits in its cluster (from the cluster config)."""

    node_id: str
    rank: int
    layers: tuple[int, int]
    address: str  # our own listener address: the identity we dial downstream with
    coordinator: str  # the coordinator's address: commands come only from it
    upstream: str | None  # the previous stage's address (None on the first stage)
    downstream: tuple[str, int] | None  # the next stage's listener (None on the last)
    model_identity: str
    cluster: str


@dataclass
class _Sequence:
    owner: str  # the bound identity that prepared it
    stream: MxclStream  # the owner's connection: replies go there
    state: SeqState  # its caches and sampler, used on the compute thread
    params: SamplingParams
    next_step: int = 0


@dataclass
class _Work(Step):
    seq: _Sequence


@dataclass
class StageStats:
    steps: int = 0  # forward passes (a batch is one)
    tokens: int = 0
    batched: int = 0  # sequence steps that ran in a batch of two or more
    refused: int = 0


class StageService:
    def __init__(self, model: StageModelLike, place: StagePlace, keyring: Keyring,
                 wire_dtype: str, *, dial_ip: str | None = None,
                 standby: bool = False) -> None:
        self._model = model
        self._place = place
        self._keyring = keyring
        self._specs = p.stage_specs(model.hidden_size, wire_dtype, first=model.first)
        self._seqs: dict[str, _Sequence] = {}
        self._queue: asyncio.Queue[_Work] = asyncio.Queue()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage")
        self._down: MxclStream | None = None
        self._down_lock = asyncio.Lock()
        self._dial_ip = dial_ip
        self._tasks: set[asyncio.Task[None]] = set()
        self.standby = standby  # prepared by a two-phase assignment, not yet activated
        self.stats = StageStats()

    def activate(self) -> None:
        """Leave standby: the weights are loaded already, so this is only a switch."""
        if self.standby:
            self.standby = False
            log.info("stage %s is active", self._place.node_id)

    @property
    def sequences(self) -> int:
        return len(self._seqs)

    # -- connections --------------------------------------------------------------------

    async def handle(self, stream: MxclStream) -> None:
        """Serve one authenticated connection (the listener's handler)."""
        who = bound_identity(stream.peer_identity, stream.peer)
        from_coordinator = identity_matches(self._place.coordinator, who)
        from_upstream = (self._place.upstream is not None
                         and identity_matches(self._place.upstream, who))
        attached = False
        try:
            while True:
                payload = await stream.recv()
                try:
                    env = parse_envelope(payload, self._specs)
                except EnvelopeError as exc:
                    await self._refuse(stream, p.ProtocolViolation(
                        p.ERR_BAD_MESSAGE, f"bad message: {exc.reason}"), None)
                    continue
                try:
                    if env.type == "act":
                        if not from_upstream:
                            raise p.ProtocolViolation(
                                p.ERR_NOT_UPSTREAM, f"activations are accepted only from the "
                                f"upstream stage {self._place.upstream}; you are {who}")
                        self._activation(env)
                        continue
                    if not from_coordinator:
                        raise p.ProtocolViolation(
                            p.ERR_NOT_COORDINATOR, f"commands are accepted only from the "
                            f"coordinator {self._place.coordinator}; you are {who}")
                    if env.type == "attach":
                        if not await self._attach(stream, env):
                            return
                        attached = True
                    elif not attached:
                        raise p.ProtocolViolation(p.ERR_BAD_MESSAGE,
                                                  "send 'attach' before any other command")
                    else:
                        await self._command(stream, who, env)
                except p.ProtocolViolation as exc:
                    await self._refuse(stream, exc, env)
        except ConnectionClosed:
            pass
        finally:
            self._forget_connection(stream)

    async def _refuse(self, stream: MxclStream, exc: p.ProtocolViolation,
                      env: Envelope | None) -> None:
        self.stats.refused += 1
        header = env.header if env is not None else {}
        seq = header.get("seq") if isinstance(header.get("seq"), str) else None
        step = header.get("step") if type(header.get("step")) is int else None
        log.warning("refused %s from %s: %s", env.type if env else "a message", stream.peer,
                    exc.message)
        await _send_quietly(stream, encode_envelope(p.error_header(exc.code, exc.message,
                                                                   seq, step)))

    def _forget_connection(self, stream: MxclStream) -> None:
        """Sequences whose owner's connection ended are released: nobody can use them."""
        gone = [s for s, seq in self._seqs.items() if seq.stream is stream]
        for s in gone:
            del self._seqs[s]
        if gone:
            log.info("released %d sequences of %s (connection ended)", len(gone), stream.peer)

    # -- commands -----------------------------------------------------------------------

    async def _attach(self, stream: MxclStream, env: Envelope) -> bool:
        place = self._place
        if self.standby:
            raise p.ProtocolViolation(p.ERR_STANDBY, f"stage {place.node_id} is prepared but "
                                      "not active yet (its assignment has not been activated)")
        theirs = env.header.get("model")
        if theirs != place.model_identity:
            message = (f"stage {place.node_id} serves model {place.model_identity}, the "
                       f"coordinator asked for model {theirs}: give both the same checkpoint")
            log.error("%s (coordinator %s)", message, stream.peer)
            await _send_quietly(stream, encode_envelope(p.error_header(
                p.ERR_MODEL_MISMATCH, message)))
            await stream.close("model mismatch")
            return False
        await stream.send(encode_envelope({
            "t": "attached", "stage": place.node_id, "rank": place.rank,
            "layers": list(place.layers), "model": place.model_identity,
            "cluster": place.cluster}))
        return True

    async def _command(self, stream: MxclStream, who: str, env: Envelope) -> None:
        seq_id = p.seq_of(env.header)
        current = self._seqs.get(seq_id)
        if current is not None and current.owner != who:
            raise p.ProtocolViolation(p.ERR_NOT_OWNER,
                                      f"sequence {seq_id} belongs to another identity")
        if env.type == "prepare":
            params = p.params_from_wire(env.header.get("params"))
            if current is None and len(self._seqs) >= p.MAX_SEQUENCES:
                raise p.ProtocolViolation(p.ERR_TOO_MANY, f"stage {self._place.node_id} "
                                          f"already holds {p.MAX_SEQUENCES} sequences")
            from mlxceld.engine.sampling import make_sampler  # mlx: only once serving

            sampler = (make_sampler(params, self._model.vocab_size) if self._model.last
                       else None)
            self._seqs[seq_id] = _Sequence(who, stream,
                                           SeqState(self._model.make_cache(), sampler), params)
            await stream.send(encode_envelope({"t": "prepared", "seq": seq_id}))
        elif env.type == "release":
            self._seqs.pop(seq_id, None)
        elif env.type == "run":
            if current is None:
                raise p.ProtocolViolation(p.ERR_UNKNOWN_SEQ,
                                          f"sequence {seq_id} is not prepared here")
            self._enqueue(seq_id, current, env, env.tensors["tokens"])

    def _activation(self, env: Envelope) -> None:
        seq_id = p.seq_of(env.header)
        seq = self._seqs.get(seq_id)
        if seq is None:  # released meanwhile, or never prepared: nothing to correlate
            log.debug("dropped an activation for unknown sequence %s", seq_id)
            return
        self._enqueue(seq_id, seq, env, env.tensors["hidden"])

    def _enqueue(self, seq_id: str, seq: _Sequence, env: Envelope, tensor: Any) -> None:
        step = p.step_of(env.header)
        if step != seq.next_step:
            raise p.ProtocolViolation(p.ERR_BAD_MESSAGE, f"sequence {seq_id}: step {step} "
                                      f"arrived, step {seq.next_step} was expected")
        seq.next_step += 1
        self._queue.put_nowait(_Work(seq_id, seq.state, step, p.sample_of(env.header), tensor,
                                     seq))

    # -- compute ------------------------------------------------------------------------

    async def run(self) -> None:
        """Take what is queued, run it in groups (``compute.plan``), forward each result.
        Runs until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                queued = [await self._queue.get()]
                while not self._queue.empty():
                    queued.append(self._queue.get_nowait())
                for group in plan(queued):
                    live = [w for w in group if isinstance(w, _Work)
                            and self._seqs.get(w.seq_id) is w.seq]  # not released meanwhile
                    if live:
                        await self._run_group(loop, live)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run_group(self, loop: asyncio.AbstractEventLoop, group: list[_Work]) -> None:
        try:
            outs = await loop.run_in_executor(self._pool, run_group, self._model, group)
        except Exception as exc:
            log.exception("a step of sequences %s failed", [w.seq_id for w in group])
            for work in group:
                self._seqs.pop(work.seq_id, None)
                await self._tell_owner(work, p.ERR_STAGE_FAILED,
                                       f"stage {self._place.node_id} failed: {exc}")
            return
        self.stats.steps += 1
        self.stats.batched += len(group) if len(group) > 1 else 0
        for work, out in zip(group, outs, strict=True):
            self.stats.tokens += work.tokens
            await self._forward(work, out)

    async def _forward(self, work: _Work, out: Any) -> None:
        if self._model.last:
            if out is None:
                return
            blob = ("tokens", "i32", (1,), struct.pack("<i", out))
            await _send_quietly(work.seq.stream, encode_envelope(
                {"t": "token", "seq": work.seq_id, "step": work.step}, [blob]))
            return
        message = encode_envelope({"t": "act", "seq": work.seq_id, "step": work.step,
                                   "sample": work.sample}, [out])
        try:
            down = await self._downstream()
            await down.send(message)
        except (ConnectionClosed, NetError) as exc:
            self._down = None
            self._seqs.pop(work.seq_id, None)
            await self._tell_owner(work, p.ERR_DOWNSTREAM,
                                   f"stage {self._place.node_id} cannot reach the next stage "
                                   f"at {_addr(self._place.downstream)}: {exc}")

    async def _downstream(self) -> MxclStream:
        async with self._down_lock:
            if self._down is not None and not self._down.closed:
                return self._down
            assert self._place.downstream is not None
            host, port = self._place.downstream
            self._down = await connect(
                host, port, keyring=self._keyring, identity=self._place.address, channel=1,
                budget_s=DOWNSTREAM_DIAL_S,
                local_addr=(self._dial_ip, 0) if self._dial_ip else None)
            self._spawn(self._drain(self._down))
            log.info("connected to the next stage at %s", _addr(self._place.downstream))
            return self._down

    async def _drain(self, stream: MxclStream) -> None:
        """Read the downstream connection: answers pongs, logs what it refuses."""
        with contextlib.suppress(ConnectionClosed):
            while True:
                payload = await stream.recv()
                log.warning("the next stage sent %d unexpected bytes (%r...)", len(payload),
                            bytes(payload[:120]))

    async def _tell_owner(self, work: _Work, code: str, message: str) -> None:
        await _send_quietly(work.seq.stream, encode_envelope(
            p.error_header(code, message, work.seq_id, work.step)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._down is not None:
            await self._down.close("stage stopping")
        self._seqs.clear()


def _addr(hp: tuple[str, int] | None) -> str:
    return "-" if hp is None else f"{hp[0]}:{hp[1]}"


async def _send_quietly(stream: MxclStream, payload: bytes) -> None:
    with contextlib.suppress(ConnectionClosed):
        await stream.send(payload)
