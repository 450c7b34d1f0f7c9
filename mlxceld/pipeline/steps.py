"""A pipeline stage's steps: queued by its service (``stage.py``), run a group at a time,
and their results sent on.

The service enqueues each step it accepts (``enqueue``: a ``run`` from the coordinator, an
``act`` from the upstream stage, a ``next`` from the last) and each released sequence's
caches to keep (``keep``). ``run`` takes them in rounds (``compute.next_groups``): a batch
of decode steps, then one prefill chunk. A step runs on the compute thread, except a
decode step while the last one took under ``INLINE_STEP_S``: that runs on the event
loop's own thread (see ``stage.py``). A step's result goes on: a stage's activations to
the next stage (``act``), the last stage's token to the sequence's owner and, unless it
ends the sequence, to the first stage as its next step (``next``; a one-stage pipeline
enqueues it here). A step that fails, or a send onward that fails, forgets its sequence
and tells its owner.

Progress, for the supervisor's watchdog: ``stats.steps``, ``stats.last_step_at`` and
``busy_since`` (while steps are queued).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from mlxceld.net import ConnectionClosed, MxclStream, Redialer
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.compute import (
    Drafted,
    Sampled,
    StageModelLike,
    next_groups,
    run_group,
)
from mlxceld.pipeline.kvstore import StageCache, cloned, held_tokens
from mlxceld.pipeline.messages import Act, Next
from mlxceld.pipeline.onward import Onward
from mlxceld.pipeline.sequences import Keep, StageSequence, StageStats, Work
from mlxceld.wire import Tensor, encode_envelope
from mlxceld.wire.transport_messages import CodedError, Token

if TYPE_CHECKING:  # mlx: imported by the stage worker only, never by the daemon
    from mlxceld.pipeline.tensor_stage import StageLeader

log = logging.getLogger(__name__)

INLINE_STEP_S: Final = 0.02  # a decode step shorter than this runs the next one inline


class StageSteps:
    """The queue of one stage's steps, the loop that runs them, and where results go."""

    def __init__(self, model: StageModelLike, node_id: str, seqs: dict[str, StageSequence],
                 cache: StageCache, onward: Onward, stats: StageStats,
                 forget: Callable[[str], None], leader: StageLeader | None = None) -> None:
        """``seqs``: the service's sequences (read here: a step of one released meanwhile
        is dropped); ``forget``: the service's, for a sequence whose step or send failed;
        ``leader``: a tensor-parallel stage's rank 0, which runs each group (its output
        None for a step of a sequence dropped meanwhile: nothing is sent on)."""
        self._model = model
        self._node_id = node_id
        self._seqs = seqs
        self._cache = cache
        self._onward = onward
        self.stats = stats
        self._forget = forget
        self._leader = leader
        self._queue: asyncio.Queue[Work | Keep] = asyncio.Queue()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage")
        self._inline = False  # the last decode step was short: run the next one inline
        self._pending = 0  # steps enqueued and not yet run (or dropped)
        self.busy_since: float | None = None  # time.monotonic() when _pending left 0

    @property
    def queued(self) -> int:
        """Steps enqueued and not yet run: the stage's queue depth."""
        return self._pending

    def keep(self, keep: Keep) -> None:
        """A released sequence's caches, to go into the prompt cache in turn."""
        self._queue.put_nowait(keep)

    def enqueue(self, seq_id: str, seq: StageSequence, step: int, sample: bool,
                tensor: Tensor, *, pos: int | None = None, ids: Tensor | None = None
                ) -> None:
        if step != seq.next_step:
            raise p.ProtocolViolation(p.ERR_BAD_MESSAGE, f"sequence {seq_id}: step {step} "
                                      f"arrived, step {seq.next_step} was expected")
        seq.next_step += 1
        if self._pending == 0:
            self.busy_since = time.monotonic()
        self._pending += 1
        self._queue.put_nowait(Work(seq_id, seq.state, step, sample, tensor, seq, pos=pos,
                                    ids=ids))

    async def run(self) -> None:
        """Take what is queued, run it in groups, send each result on; until cancelled."""
        try:
            await self._take_and_run()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _take_and_run(self) -> None:
        """Each round: the caches of released sequences kept, then a batch of decode steps
        and one other step (a prefill chunk), then what arrived meanwhile: so decoding
        sequences wait at most one prefill chunk for their next step, however long the
        prompt being prefilled, and the prompt's chunks still go one after the other."""
        loop = asyncio.get_running_loop()
        queued: list[Work] = []
        while True:
            taken = [] if queued else [await self._queue.get()]
            while not self._queue.empty():
                taken.append(self._queue.get_nowait())
            for item in taken:
                if isinstance(item, Keep):
                    await self._keep(item)
                else:
                    queued.append(item)
            groups, queued = next_groups(queued)
            for group in groups:
                live = [w for w in group if isinstance(w, Work)
                        and self._seqs.get(w.seq_id) is w.seq]  # not released meanwhile
                if live:
                    await self._run_group(loop, live)
                self._done(len(group))
            # A step run inline, and a one-stage pipeline's next step put in the queue by
            # the step itself, suspend nothing: without this the loop would read no
            # message (a prepare, a cancel) until every sequence here had ended.
            await asyncio.sleep(0)

    async def _keep(self, keep: Keep) -> None:
        """A released sequence's caches into the prompt cache, as the router named them."""
        await send_quietly(keep.seq.stream, encode_envelope(self._cache.put(
            keep.seq.owner, keep.entry, keep.seq.state.cache, keep.tokens,
            (keep.seq_id, False)).to_wire()))

    def _done(self, n: int) -> None:
        """``n`` enqueued steps are run or dropped: the stage has work while any are left."""
        self._pending = max(0, self._pending - n)
        if self._pending == 0:
            self.busy_since = None

    async def _run_group(self, loop: asyncio.AbstractEventLoop, group: list[Work]) -> None:
        for w in group:  # a speculating sequence proposes while it is alone here
            if w.state.spec is not None:
                w.state.spec.allowed = len(self._seqs) == 1
        try:
            decode = all(_decoding(w) for w in group)
            if decode and self._inline:
                self.stats.inline += 1
                outs, kept = self._compute(group, False)
            else:
                outs, kept = await loop.run_in_executor(self._pool, self._compute, group,
                                                        True)
        except Exception as exc:
            self.stats.last_step_at = time.monotonic()  # ended, if badly: not a stall
            log.exception("a step of sequences %s failed", [w.seq_id for w in group])
            for work in group:
                self._forget(work.seq_id)
                await self._tell_owner(work, p.ERR_GROUP_BROKEN if isinstance(
                    exc, p.GroupBroken) else p.ERR_STAGE_FAILED,
                    f"stage {self._node_id} failed: {exc}")
            return
        self.stats.steps += 1
        self.stats.last_step_at = time.monotonic()
        for work, caches in kept:  # its prompt is prefilled: kept once, as the router named
            entry, work.seq.snapshot = work.seq.snapshot, None
            assert entry is not None
            await send_quietly(work.seq.stream, encode_envelope(self._cache.put(
                work.seq.owner, entry, caches, held_tokens(caches),
                (work.seq_id, True)).to_wire()))
        for work, out in zip(group, outs, strict=True):
            self.stats.tokens += work.tokens
            if out is not None or self._leader is None:  # None: dropped while it waited
                await self._forward(work, out)

    def _compute(self, group: list[Work], overlap: bool
                 ) -> tuple[list[Any], list[tuple[Work, list[Any]]]]:
        """One group's step, timed (on the compute thread, or inline: see above), and the
        copies of the caches of the sequences whose prompt it finished and whose router
        asked to keep it (``keep_prompt``; a tensor stage's followers copy theirs alike,
        but for a step left out: its output None). Steps long enough for the compute thread
        overlap building a layer's graph with running the one before
        (``StageModel.forward``); short ones gain nothing by it."""
        start = time.perf_counter()
        snap = [w for w in group if w.sample and w.seq.snapshot is not None]
        try:
            if self._leader is None:
                outs = run_group(self._model, group, overlap=overlap)
            else:
                outs = self._leader.run_group(group, overlap=overlap,
                                              snap={w.seq_id for w in snap})
            ran = {id(w) for w, out in zip(group, outs, strict=True)
                   if out is not None or self._leader is None}
            kept = [(w, cloned(w.state.cache, held_tokens(w.state.cache))) for w in snap
                    if id(w) in ran]
            return outs, kept
        finally:
            took = time.perf_counter() - start
            self.stats.compute_s += took
            if all(_decoding(w) for w in group):
                self._inline = took < INLINE_STEP_S

    async def _forward(self, work: Work, out: Any) -> None:
        if not self._model.last:
            ids = work.x if self._model.first else work.ids
            tensors: list[Any] = [out] if ids is None else \
                [out, ("tokens", "i32", ids.shape, ids.data)]
            await self._send_on(self._onward.down, work, encode_envelope(
                Act(work.seq_id, work.step, work.sample, work.pos).to_wire(), tensors))
            return
        if out is None:
            return
        drafted = out if isinstance(out, Drafted) else Drafted((out,))
        seq = work.seq
        if seq.produced == 0:
            seq.token_base = work.step  # tokens are numbered on from here (protocol.py)
        tokens = []
        for sampled in drafted.tokens:
            assert isinstance(sampled, Sampled)
            tokens.append((sampled, seq.token_base + seq.produced))
            seq.produced += 1
            if sampled.token in seq.eos or seq.produced >= seq.params.max_tokens:
                break
        await self._continue(work, drafted, tokens[-1][0].token)
        for sampled, number in tokens:
            token = Token(work.seq_id, number) if sampled.logprob is None \
                else Token(work.seq_id, number, sampled.logprob, tuple(sampled.top))
            await send_quietly(seq.stream, encode_envelope(
                token.to_wire(), [("tokens", "i32", (1,), struct.pack("<i", sampled.token))]))

    async def _continue(self, work: Work, drafted: Drafted, token: int) -> None:
        """Run ``token`` (and the draft's proposals after it) as the sequence's next step,
        unless it ends the sequence: on the first stage, by a ``next`` message or (a
        one-stage pipeline) here."""
        seq = work.seq
        if (token in seq.eos or seq.produced >= seq.params.max_tokens
                or self._seqs.get(work.seq_id) is not seq):
            return
        run = (token, *drafted.drafts)
        blob = struct.pack(f"<{len(run)}i", *run)
        if self._model.first:
            self.enqueue(work.seq_id, seq, work.step + 1, True,
                         Tensor("tokens", "i32", (1, len(run)), memoryview(blob)),
                         pos=drafted.pos)
            return
        await self._send_on(self._onward.ring, work, encode_envelope(
            Next(work.seq_id, work.step + 1, drafted.pos).to_wire(),
            [("tokens", "i32", (1, len(run)), blob)]))

    async def _send_on(self, dialer: Redialer, work: Work, message: bytes) -> None:
        failure = await self._onward.send(dialer, message)
        if failure is not None:
            self._forget(work.seq_id)
            await self._tell_owner(work, p.ERR_DOWNSTREAM,
                                   f"stage {self._node_id} {failure}")

    async def _tell_owner(self, work: Work, code: str, message: str) -> None:
        await send_quietly(work.seq.stream, encode_envelope(
            CodedError(code, message, work.seq_id, work.step).to_wire()))


def _decoding(work: Work) -> bool:
    """A decode step: one token, or a speculative pass (it carries where it starts)."""
    return work.tokens == 1 or work.pos is not None


async def send_quietly(stream: MxclStream, payload: bytes) -> None:
    with contextlib.suppress(ConnectionClosed):
        await stream.send(payload)
