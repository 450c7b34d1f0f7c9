"""The local engine: the whole model in this process, continuous batching with mlx-lm.

One thread owns the model and mlx-lm's ``BatchGenerator``: it takes new and
cancelled sequences from a thread-safe inbox between steps, runs one step
(a prefill chunk and/or one batched decode step for every active sequence),
and hands each token to its request's asyncio queue. Concurrent requests
therefore share each decode step. The asyncio side never touches mlx.

A request with a constraint (``SamplingParams.constraint``) gets its own matcher, built
off the step thread (``engine/constraints.py``), as one more logits processor.

``prefill`` prefills a prompt for a handoff on the step thread, between batch steps, on
from the longest prefix its prompt cache holds (a copy of the prompt's cache is kept
there: the next turn of a chat prefills only its new part); ``generate_from`` continues
a sequence another host prefilled (``engine/handoff.py``): its cache joins the batch with
the first token as its only prompt token. ``prompt_cache_stats`` says what the prompt
cache (``engine/prompt_cache.py``) saved.

With a ``Mirror`` (``engine/tensor.py``) the engine is rank 0 of a tensor-parallel group:
before each step the step thread shares what changed in the batch with the other ranks
(``engine/follower.py``'s ``Follower`` on each of them), and its sampled tokens go to them.

With ``kv_quant`` (``[serve] kv_bits``) every sequence's cache is ``engine/kvquant.py``'s
``QuantizingKVCache`` per layer, batched as any other (a prefix from the prompt cache
included; a handed-off cache is quantized from its next step): greedy tokens are mlx-lm's
``generate_step`` with the same ``kv_bits``, ``kv_group_size`` and ``quantized_kv_start``
(that module says exactly when). ``loading.engine_for`` refuses a model that cannot keep
one.

With a ``Draft`` (``[serve] draft_model``) a sequence alone in the engine is decoded
speculatively outside the batch while it stays alone, its cache the batch's kind
(``engine/speculative.py`` says when and how; ``engine/solo.py`` how a tensor-parallel
group's other ranks follow).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from mlxceld.engine import batching
from mlxceld.engine.base import (
    EngineError,
    EngineUnavailable,
    GenerationRequest,
    SamplingParams,
    TokenOutput,
)
from mlxceld.engine.constraints import ConstraintError, ConstraintTokenizer, Matching
from mlxceld.engine.handoff import (
    DEFAULT_PREFILL_STEP,
    CacheLayout,
    check_handoff,
    check_prefill,
    check_resumable,
    prefill,
    resume_sampling,
    snapshot,
)
from mlxceld.engine.kvquant import quantizing
from mlxceld.engine.processors import make_logits_processors
from mlxceld.engine.prompt_cache import DEFAULT_BYTES, PromptCache
from mlxceld.engine.sampling import make_sampler
from mlxceld.engine.solo import Solo
from mlxceld.engine.speculative import Draft, Speculation
from mlxceld.engine.tensor import GROUP_RETRY_S, Mirror, Op, broke
from mlxceld.roles.options import KVQuant
from mlxceld.types import PromptCacheStats

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle step thread sleeps before re-checking for shutdown


@dataclass(eq=False)  # each one itself (kept in a set)
class _Sequence:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[TokenOutput | BaseException]
    uid: int | None = None
    matching: Matching | None = None  # the request's constraint, if it has one
    # A handed-off sequence: its first token (sampled elsewhere) and its prompt's cache.
    handoff: tuple[int, Sequence[Any]] | None = None
    cached: int | None = None  # prompt tokens from the prompt cache, until the first output
    speculation: Speculation | None = None  # with the draft (or parked while batched)


class LocalEngine:
    """Implements ``Engine`` over an mlx-lm model loaded in this process."""

    def __init__(self, model: Any, *, model_id: str, context_length: int,
                 eos_token_ids: set[int], vocab_size: int, max_batch: int = 8,
                 prefill_step: int = DEFAULT_PREFILL_STEP,
                 on_failure: Callable[[BaseException], None] | None = None,
                 constraints: ConstraintTokenizer | ConstraintError | None = None,
                 mirror: Mirror | None = None, prompt_cache_bytes: int | None = None,
                 kv_quant: KVQuant | None = None, draft: Draft | None = None) -> None:
        """``constraints``: what builds a constrained request's matcher, or why this model
        has none (such a request is refused with that ``ConstraintError``); ``mirror``:
        this engine is rank 0 of a tensor-parallel group (``engine/tensor.py``);
        ``prompt_cache_bytes``: its prompt cache's bound (0: none kept; None:
        ``prompt_cache.DEFAULT_BYTES``), the whole group's with a mirror: each of its N
        ranks holds a slice of every cache, and keeps at most 1/N of the bytes;
        ``kv_quant``: a quantized KV cache (the model checked for it: ``loading.py``);
        ``draft``: speculative decoding (``engine/solo.py``)."""
        self.model_id = model_id
        self.context_length = context_length
        self.max_batch = max_batch
        self.vocab_size = vocab_size  # the model's: token ids in [0, vocab_size)
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._prefill_step = prefill_step
        self._constraints = constraints
        self.kv_quant = kv_quant
        if kv_quant is not None:
            log.info("engine for %s: %s", model_id, kv_quant)
        self._gen: Any = batching.generator(model, eos_token_ids, max_batch, prefill_step)
        self._mirror = mirror
        self.draft = draft  # loading.py checks that both models' caches trim back
        self._spec: _Sequence | None = None  # the sequence decoded speculatively, if any
        if mirror is not None:
            mirror.on_broken, mirror.on_silent = self._group_broke, self._group_silent
        self.stalled: EngineUnavailable | None = None  # while a tensor-parallel rank is silent
        self._live: set[_Sequence] = set()  # the sequences whose requests wait
        # KV caches of finished sequences, by their tokens: a new prompt that shares a
        # prefix (a chat's earlier turns, a repeated system prompt) skips that prefill.
        self._prompt_cache = PromptCache((DEFAULT_BYTES if prompt_cache_bytes is None
                                          else prompt_cache_bytes) // self.tensor_parallel)
        # What changed in the batch since the last step, for the other ranks (with a mirror:
        # each builds its prompt cache as ours, so that they reuse alike).
        self._ops: list[Op] = [] if mirror is None else [
            ("setup", sorted(eos_token_ids), max_batch, prefill_step,
             self._prompt_cache.max_bytes, kv_quant)]
        self._solo = None if draft is None else Solo(
            draft, model, prompt_cache=self._prompt_cache, vocab_size=vocab_size,
            eos_token_ids=eos_token_ids, prefill_step=prefill_step, kv_quant=kv_quant,
            stream=self._gen.stream, mirror=mirror, share=self._share, tell=self._ops.append)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._by_uid: dict[int, _Sequence] = {}
        self._active = 0
        self._closed = threading.Event()
        self._failure: BaseException | None = None
        self._on_failure = on_failure  # called on the step thread when the engine breaks
        self._thread = threading.Thread(target=self._run, name="mlxceld-engine", daemon=True)
        self._thread.start()

    # -- asyncio side ---------------------------------------------------------------------

    def active_sequences(self) -> int:
        return self._active

    def prompt_cache_stats(self) -> PromptCacheStats:
        """What the prompt cache saved so far and holds now (read from any thread); with a
        mirror, the bytes of every rank's slices (each holds as many as this one)."""
        stats = self._prompt_cache.stats()
        stats["bytes"] *= self.tensor_parallel
        return stats

    @property
    def tensor_parallel(self) -> int:
        """How many ranks the model is split over (1: this process holds it whole)."""
        return 1 if self._mirror is None else self._mirror.size

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        seq = await self._sequence(request)
        async with contextlib.aclosing(self._stream(seq)) as outputs:
            async for item in outputs:
                yield item

    async def generate_from(self, request: GenerationRequest, first: TokenOutput,
                            cache: Sequence[Any]) -> AsyncGenerator[TokenOutput, None]:
        """Continue ``request`` from another host's prefill: ``first`` (its first token,
        yielded here first; it counts toward max_tokens) and ``cache`` (the prompt's, a
        ``KVCache`` per layer: ``handoff.decode_cache``'s), batched with every other
        sequence. From a lossless (``none``) cache, greedy tokens are the one-host tokens
        (the module docstring of ``engine/handoff.py`` says what seeded sampling gives)."""
        self._check_handoff_here()
        check_resumable(request, first, cache, len(self._gen.model.layers), self._vocab_size)
        seq = await self._sequence(request)
        seq.handoff = (first.token, cache)
        yield first
        if first.finish_reason is not None:
            return
        async with contextlib.aclosing(self._stream(seq)) as outputs:
            async for item in outputs:
                yield item

    def cache_layout(self) -> CacheLayout:
        """What this model's cache looks like: what a handed-off one is checked against."""
        return CacheLayout.of(self._gen.model)

    async def prefill(self, request: GenerationRequest) -> tuple[TokenOutput, list[Any]]:
        """``request``'s first token and its prompt's cache, for another host to decode on
        (``handoff.prefill`` on the step thread, between batch steps: the batch waits for
        it as for any prompt), on from the longest prefix the prompt cache holds; a copy
        of the prompt's cache is kept there (the caller may extend or drop its own). A
        model whose cache cannot be handed off is refused first (``HandoffUnsupported``),
        before any work; the engine keeps serving."""
        self._check_handoff_here()
        check_handoff(self._gen.model, str(getattr(self._gen.model, "model_type", "")
                                            or self.model_id))
        seq = await self._sequence(request)
        done: concurrent.futures.Future[tuple[TokenOutput, list[Any]]] = \
            concurrent.futures.Future()
        self._inbox.put(("prefill", (seq, done)))
        return await asyncio.wrap_future(done)

    def _check_handoff_here(self) -> None:
        if self._mirror is not None:
            raise EngineError(f"this engine splits its model over {self._mirror.size} "
                              "tensor-parallel ranks; a KV handoff (prefill/decode "
                              "disaggregation) needs tp_size 1")

    async def _sequence(self, request: GenerationRequest) -> _Sequence:
        refusal = self._failure or self.stalled
        if isinstance(refusal, EngineUnavailable):  # the tensor-parallel group's: 503
            raise refusal
        if self._failure is not None or self._closed.is_set():
            raise EngineError(f"the engine is not running: {self._failure or 'closed'}")
        seq = _Sequence(request, asyncio.get_running_loop(), asyncio.Queue())
        if request.params.constraint is not None:  # compiling may take a while: not here
            seq.matching = await asyncio.to_thread(self._matching, request.params)
        return seq

    async def _stream(self, seq: _Sequence) -> AsyncGenerator[TokenOutput, None]:
        """``seq``'s tokens from the step thread; closing early cancels it there."""
        self._active += 1
        self._live.add(seq)
        self._inbox.put(("insert", seq))
        finished = False
        try:
            while True:
                item = await seq.out.get()
                if isinstance(item, EngineUnavailable):
                    raise item  # the tensor-parallel group's: 503 naming the rank
                if isinstance(item, BaseException):
                    raise EngineError(f"generation failed: {item}") from item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._active -= 1
            self._live.discard(seq)
            if not finished:
                self._inbox.put(("cancel", seq))

    def _matching(self, params: SamplingParams) -> Matching:
        constraint = params.constraint
        assert constraint is not None
        if not isinstance(self._constraints, ConstraintTokenizer):
            why = self._constraints or "this engine was built without constrained decoding"
            raise ConstraintError(str(why))
        return self._constraints.matcher(constraint)

    async def aclose(self) -> None:
        self._closed.set()
        self._inbox.put(("wake", None))
        await asyncio.to_thread(self._thread.join, 30.0)

    # -- the step thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                self._drain_inbox(block=not self._by_uid and self._spec is None)
                if self._mirror is not None:  # the other ranks take the same step
                    self._share()
                if self._spec is not None and not self._by_uid:
                    self._speculate(self._spec)
                elif self._by_uid:
                    with self._mirror.stepping() if self._mirror else contextlib.nullcontext():
                        self._step()
            if self._mirror is not None:
                self._ops.append(("close",))
                self._share()
                self._mirror.close()
        except BaseException as exc:  # the engine is broken: fail every waiting request
            log.exception("engine step thread failed")
            self._failure = exc if self._mirror is None else broke(self._mirror.explain(exc))
            for seq in [*self._by_uid.values(), *filter(None, [self._spec])]:
                self._deliver(seq, self._failure)
            self._by_uid.clear()
            if self._on_failure is not None:
                self._on_failure(exc)
        finally:
            self._gen.close()
            self._fail_prefills()
            mx.clear_streams()  # this thread's own, now: at its exit they race a teardown

    def _group_broke(self, why: str) -> None:
        """The tensor-parallel group broke (told on the watchdog's thread, the step thread
        waiting for good): the waiting requests fail (``broke``), the engine is failed."""
        self._failure = exc = broke(why)
        for seq in list(self._live):
            self._deliver(seq, exc)
        if self._on_failure is not None:
            self._on_failure(exc)

    def _group_silent(self, why: str | None) -> None:
        """A rank went silent (``why``): requests fail, 503 naming it, until None."""
        stalled = None if why is None else EngineUnavailable(why, retry_after_s=GROUP_RETRY_S)
        self.stalled = stalled
        log.warning("%s", why or "every tensor-parallel rank is heard again")
        if stalled is not None:
            for seq in list(self._live):
                self._deliver(seq, stalled)

    def _share(self) -> None:
        assert self._mirror is not None
        ops = self._ops[:]  # the list itself stays: Solo's ``tell`` appends to it
        self._ops.clear()
        with mx.stream(self._gen.stream):
            self._mirror.share(ops)

    def _fail_prefills(self) -> None:
        """Answer the prefills still queued when the step thread ends (their callers wait)."""
        while True:
            try:
                command, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "prefill":
                item[1].set_exception(EngineError(
                    f"the engine stopped before the prompt was prefilled: "
                    f"{self._failure or 'closed'}"))

    def _drain_inbox(self, *, block: bool) -> None:
        try:
            command, seq = self._inbox.get(timeout=IDLE_WAIT_S) if block \
                else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if command == "insert":
                self._insert(seq)
            elif command == "prefill":
                self._prefill(*seq)
            elif command == "cancel" and self._spec is not None and seq is self._spec:
                assert self._solo is not None and self._spec.speculation is not None
                self._solo.end(self._spec.speculation, finished=False)
                self._spec = None
            elif command == "cancel" and seq.uid is not None \
                    and self._by_uid.pop(seq.uid, None) is not None:
                self._gen.remove([seq.uid])
                if self._mirror is not None:
                    self._ops.append(("remove", seq.uid))
            try:
                command, seq = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _insert(self, seq: _Sequence) -> None:
        req = seq.request
        tokens = list(req.prompt_tokens)
        try:
            batching.check_vocabulary(req.params, self._vocab_size)
            if self._spec is not None:  # it speculates while alone, no longer
                self._join_batch(self._spec)
            if self._speculated(seq, tokens):
                return
            if seq.handoff is not None:  # the first token was sampled by the prefill host
                first, cache = seq.handoff
                sampler, processors = resume_sampling(req.params, tokens, self._vocab_size,
                                                      seq.matching, self._eos_token_ids)
                [uid] = self._gen.insert(
                    [[first]], max_tokens=[req.params.max_tokens - 1],
                    caches=[list(cache) if self.kv_quant is None
                            else quantizing(cache, self.kv_quant)],
                    all_tokens=[tokens], samplers=[sampler], logits_processors=[processors])
            else:
                sampler = make_sampler(req.params, self._vocab_size)
                shared = False
                if self._mirror is not None:
                    sampler, shared = self._mirror.sampler(sampler)
                processors = make_logits_processors(req.params, self._eos_token_ids)
                prefix, rest = self._prompt_cache.fetch(tokens)
                seq.cached = len(tokens) - len(rest)
                if prefix is None:
                    prefix = batching.fresh_cache(self._gen.model, self.kv_quant)
                [uid] = self._gen.insert(
                    [rest], max_tokens=[req.params.max_tokens], caches=[prefix],
                    all_tokens=[tokens[: len(tokens) - len(rest)]],
                    samplers=[sampler],
                    logits_processors=[processors + batching.constraint_processors(seq.matching)],
                )
                if self._mirror is not None:
                    self._ops.append(("insert", uid, tokens, req.params.max_tokens,
                                      len(tokens) - len(rest), shared))
        except (ValueError, TypeError) as exc:  # a bad parameter fails its request only
            # (empty prompt, max_tokens, a seed mlx refuses: caught above us normally)
            self._deliver(seq, exc)
            return
        seq.uid = uid
        self._by_uid[uid] = seq

    def _speculated(self, seq: _Sequence, tokens: list[int]) -> bool:
        """Whether ``seq`` starts speculating (``engine/speculative.py``'s rule)."""
        if self._solo is None or self._by_uid or seq.handoff is not None \
                or not self._solo.draft.takes(seq.request.params, seq.matching is not None):
            return False
        self._spec, seq.speculation = seq, self._solo.start(tokens, seq.request.params)
        return True

    def _join_batch(self, seq: _Sequence) -> None:
        """``seq`` leaves speculation for the batch (its first token says what was cached)."""
        spec = seq.speculation
        assert spec is not None and self._solo is not None
        seq.uid = self._solo.join(spec, self._gen)
        seq.cached = spec.cached if spec.generated == 0 else None
        self._by_uid[seq.uid] = seq
        self._spec = None  # its speculation parked: its draft's cache, should it come back

    def _back_to_solo(self, emitted: set[int]) -> None:
        """The batch's last sequence speculates again if it may (``Solo.resume``)."""
        [(uid, seq)] = self._by_uid.items()
        assert self._solo is not None
        if uid not in emitted or not self._inbox.empty() or seq.handoff is not None \
                or not self._solo.draft.takes(seq.request.params, seq.matching is not None):
            return
        spec = self._solo.resume(self._gen, uid, seq.request.prompt_tokens,
                                 seq.request.params, seq.speculation)
        if spec is not None:
            del self._by_uid[uid]
            seq.uid, self._spec, seq.speculation = None, seq, spec

    def _speculate(self, seq: _Sequence) -> None:
        """One step of the sequence decoded speculatively: its tokens delivered at once."""
        assert seq.speculation is not None and self._solo is not None
        outs = self._solo.step(seq.speculation)  # its cache kept once it ends
        if outs:
            self._spec = None if outs[-1].finish_reason is not None else seq
            with contextlib.suppress(RuntimeError):  # the request's loop is gone
                seq.loop.call_soon_threadsafe(batching.put_all, [(seq.out, o) for o in outs])

    def _prefill(self, seq: _Sequence,
                 done: concurrent.futures.Future[tuple[TokenOutput, list[Any]]]) -> None:
        req = seq.request
        try:
            check_prefill(req.prompt_tokens, req.params, self._vocab_size)
            cached, rest = self._prompt_cache.fetch(req.prompt_tokens)
            first, cache = prefill(self._gen.model, req.prompt_tokens, req.params,
                                   vocab_size=self._vocab_size,
                                   eos_token_ids=self._eos_token_ids, matching=seq.matching,
                                   prefill_step=self._prefill_step, cache=cached)
            # What the prompt cache gave: the first token says it, to the decode node.
            first = replace(first, cached=len(req.prompt_tokens) - len(rest))
            # A copy (a view: no bytes copied): the handed-off cache is the caller's, who
            # may extend it in place.
            self._prompt_cache.keep(req.prompt_tokens, snapshot(cache))
            done.set_result((first, cache))
        except (ValueError, TypeError) as exc:  # a bad request fails alone, as in _insert
            done.set_exception(exc)
        except BaseException as exc:  # the engine is broken: this waiter hears it too
            done.set_exception(EngineError(f"prefill failed: {exc}"))
            raise

    def _step(self) -> None:
        _, generated = self._gen.next()
        batch: list[tuple[_Sequence, TokenOutput]] = []
        for r in generated:
            seq = self._by_uid.get(r.uid)
            if seq is None:
                continue  # cancelled while this step ran
            reason = r.finish_reason if r.finish_reason in ("stop", "length") else None
            if r.finish_reason is not None and reason is None:
                reason = "length"  # anything else that ends a sequence ends it for length
            out = batching.output_of(seq.request.params, r, reason)
            if seq.cached is not None:  # its first output says what the prompt cache gave
                out, seq.cached = replace(out, cached=seq.cached), None
            batch.append((seq, out))
            if reason is not None:
                del self._by_uid[r.uid]
                # A handed-off cache may be lossy (int8, int4): not for other requests.
                if seq.handoff is None and r.prompt_cache is not None:
                    self._prompt_cache.keep(r.all_tokens, r.prompt_cache)
        # One wake-up of the event loop per step, not one per sequence: each wake-up
        # costs the step thread a GIL hand-over.
        loops = {seq.loop for seq, _ in batch}
        for loop in loops:
            items = [(seq.out, item) for seq, item in batch if seq.loop is loop]
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody listens
                loop.call_soon_threadsafe(batching.put_all, items)
        if self._solo is not None and len(self._by_uid) == 1:
            self._back_to_solo({r.uid for r in generated})

    @staticmethod
    def _deliver(seq: _Sequence, item: TokenOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the request's loop is gone: nobody listens
            seq.loop.call_soon_threadsafe(seq.out.put_nowait, item)
