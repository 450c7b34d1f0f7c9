"""A tensor-parallel follower: rank 1..N-1 of a group whose rank 0 is a ``LocalEngine``
(``engine/tensor.py``: ``run_tensor_follower``). It takes rank 0's batch steps on its own
slices of the model, with its own ``BatchGenerator`` and prompt cache built as rank 0's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxceld.engine.base import EngineError
from mlxceld.engine.batching import fresh_cache, generator
from mlxceld.engine.prompt_cache import PromptCache
from mlxceld.engine.solo import Followed
from mlxceld.engine.tensor import Mirror, Op
from mlxceld.roles.options import KVQuant


class Follower:
    """Rank 1..N-1 of a tensor-parallel engine: rank 0's steps on this rank's slices of
    the model (``engine/tensor.py``: ``run_tensor_follower``). Its generator is built as
    rank 0's from rank 0's ``setup`` op, so they batch, chunk, stop, keep prompt caches
    (each rank's caches are its slices': the same bytes as rank 0's, so the same ones are
    dropped) and quantize their KV caches (``kv_quant``) alike."""

    def __init__(self, model: Any, mirror: Mirror, *, max_batch: int) -> None:
        self._model = model
        self._mirror = mirror
        self._max_batch = max_batch
        self._prompt_cache = PromptCache()  # rank 0's setup sets its bound
        self._live: set[int] = set()
        self._kv_quant: KVQuant | None = None  # rank 0's, from its setup op
        self._solo: Followed | None = None  # the sequence rank 0 decodes speculatively
        self.steps = 0  # batch steps taken (read from another thread: for the worker's stats)

    @property
    def sequences(self) -> int:
        """Sequences in this rank's batch now."""
        return len(self._live)

    def run(self) -> None:
        """Follow until rank 0 shares ``close``; mlx raises ``RuntimeError`` when the
        ring breaks, ``EngineError`` where this rank cannot follow (a bug)."""
        from mlx_lm.generate import generation_stream
        gen: Any = None
        try:
            while True:
                with mx.stream(generation_stream if gen is None else gen.stream):
                    ops = self._mirror.share([])
                for op in ops:
                    if op[0] == "close":
                        self._mirror.close()
                        return
                    gen = self._apply(gen, op)
                if self._live:
                    with self._mirror.stepping():
                        self._step(gen)
                    self.steps += 1
        finally:
            if gen is not None:
                gen.close()

    def _apply(self, gen: Any, op: Op) -> Any:
        if op[0] == "setup":
            eos, max_batch, prefill_step, cache_bytes, self._kv_quant = op[1:6]
            if max_batch != self._max_batch:
                raise EngineError(f"rank 0 batches {max_batch} sequences and this rank "
                                  f"{self._max_batch}: every rank needs the same max_batch")
            self._prompt_cache = PromptCache(cache_bytes)
            return generator(self._model, set(eos), max_batch, prefill_step)
        if gen is None:
            raise EngineError(f"rank 0 sent {op[0]!r} before setup")
        if op[0] == "insert":
            _, uid, tokens, max_tokens, spared, shared = op
            cache, rest = self._prompt_cache.fetch(tokens)
            if cache is None:
                cache = fresh_cache(self._model, self._kv_quant)
            if len(tokens) - len(rest) != spared:
                raise EngineError(f"this rank's prompt cache holds {len(tokens) - len(rest)} "
                                  f"tokens of sequence {uid}'s prompt, rank 0's {spared}")
            [got] = gen.insert([rest], max_tokens=[max_tokens], caches=[cache],
                               all_tokens=[tokens[: len(tokens) - len(rest)]],
                               samplers=[self._mirror.follower(shared)])
            if got != uid:
                raise EngineError(f"this rank numbered a sequence {got}, rank 0 {uid}")
            self._live.add(uid)
        elif op[0].startswith("spec"):
            self._speculate(gen, op)
        elif op[0] == "remove":
            gen.remove([op[1]])
            self._live.discard(op[1])
        else:
            raise EngineError(f"rank 0 sent an op this rank does not know: {op[0]!r}")
        return gen

    def _speculate(self, gen: Any, op: Op) -> None:
        """Rank 0's speculating sequence (``engine/solo.py`` lists these ops)."""
        solo = self._solo
        if op[0] == "spec":
            self._solo = Followed.start(self._model, self._prompt_cache, list(op[1]), op[2],
                                        self._kv_quant)
            return
        if op[0] == "spec_back":
            self._solo = Followed.back(self._model, gen, op[1])
            self._live.discard(op[1])
            return
        if solo is None:
            raise EngineError(f"rank 0 sent {op[0]!r} with no speculating sequence")
        if op[0] == "spec_run":
            with mx.stream(gen.stream), self._mirror.stepping():
                solo.run(*op[1:4])
        elif op[0] == "spec_join":
            _, uid, keep, pending, max_tokens, shared = op
            got = solo.join(gen, keep, pending, max_tokens, self._mirror.follower(shared))
            if got != uid:
                raise EngineError(f"this rank numbered a sequence {got}, rank 0 {uid}")
            self._live.add(uid)
            self._solo = None
        elif op[0] == "spec_end":
            solo.end(self._prompt_cache, op[1])
            self._solo = None
        else:
            raise EngineError(f"rank 0 sent an op this rank does not know: {op[0]!r}")

    def _step(self, gen: Any) -> None:
        _, generated = gen.next()
        for r in generated:
            if r.finish_reason is not None:
                self._live.discard(r.uid)
                if r.prompt_cache is not None:
                    self._prompt_cache.keep(r.all_tokens, r.prompt_cache)
