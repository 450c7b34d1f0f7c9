"""The one sequence a local engine decodes speculatively (``engine/speculative.py``) and,
when the engine is rank 0 of a tensor-parallel group (``engine/tensor.py``), what its
other ranks are told so that they run the same target passes.

The draft runs on rank 0 alone, whole (it is small: splitting it would add a collective
per draft token); the other ranks run only the target's passes, on their slices of it,
with the ids rank 0 tells them. Rank 0's op log (``Mirror.share``) carries:

- ``("spec", tokens, spared)``: a sequence starts speculating, its first ``spared``
  tokens from the prompt cache (every rank's holds the same entries);
- ``("spec_run", keep, ids, whole)``, shared just before each of rank 0's target passes:
  trim the sequence's cache to its first ``keep`` tokens (the accepted ones), then run
  ``ids``; ``whole``: the pass's logits are computed (a verify pass), else only the cache
  (a prefill chunk), so that every rank's collectives pair up with rank 0's;
- ``("spec_join", uid, keep, pending, max_tokens, shared)``: it joins the batch as
  ``uid`` (another sequence arrived), its cache trimmed to ``keep`` tokens, ``pending``
  its prompt there (``Follower``'s ``insert``, with rank 0's sampler pattern ``shared``);
- ``("spec_end", keep)``: it ended; its cache, trimmed to ``keep`` tokens, goes into
  the prompt cache as rank 0's does; ``keep`` None: cancelled, dropped;
- ``("spec_back", uid)``: the batch's one sequence left, ``uid``, leaves the batch to
  speculate again (``Solo.resume``), with its cache and the tokens in it.

Each rank's cache of the sequence therefore holds the same tokens as rank 0's before
every pass. The acceptance (greedy or the rejection rule) is rank 0's alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxceld.engine.base import EngineError, SamplingParams, TokenOutput
from mlxceld.engine.kvquant import QuantizingKVCache, quantizing_caches
from mlxceld.engine.prompt_cache import PromptCache
from mlxceld.engine.sampling import make_sampler
from mlxceld.engine.speculative import Draft, Speculation, rewind
from mlxceld.engine.tensor import Mirror, Op
from mlxceld.roles.options import KVQuant


class Solo:
    """Rank 0's (or a lone engine's) side: starts, steps, joins and ends the sequence
    decoded speculatively; with a mirror, each of these told to the other ranks (``tell``
    queues an op, ``share`` sends the queue now; neither is called without one)."""

    def __init__(self, draft: Draft, model: Any, *, prompt_cache: PromptCache,
                 vocab_size: int, eos_token_ids: set[int], prefill_step: int, stream: Any,
                 kv_quant: KVQuant | None = None, mirror: Mirror | None = None,
                 tell: Callable[[Op], None] = lambda _: None,
                 share: Callable[[], None] = lambda: None) -> None:
        """``kv_quant``: the batch's quantized KV cache, the target's cache's kind too."""
        self.draft = draft
        self._kv_quant = kv_quant
        self._model = model
        self._prompt_cache = prompt_cache
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._prefill_step = prefill_step
        self._stream = stream
        self._mirror = mirror
        self._tell = tell if mirror is not None else lambda _: None
        self._share = share
        self._declined: int | None = None  # the batch uid ``resume`` last left there

    def start(self, tokens: Sequence[int], params: SamplingParams) -> Speculation:
        """A sequence of ``tokens`` decoded speculatively, from the prompt cache's prefix."""
        cache, rest = self._prompt_cache.fetch(tokens)
        self._tell(("spec", list(tokens), len(tokens) - len(rest)))
        return self._speculation(tokens, params, cache)

    def _speculation(self, tokens: Sequence[int], params: SamplingParams,
                     cache: list[Any] | None) -> Speculation:
        return Speculation(self.draft, self._model, tokens, params, cache=cache,
                           vocab_size=self._vocab_size, eos_token_ids=self._eos,
                           prefill_step=self._prefill_step, stream=self._stream,
                           kv_quant=self._kv_quant,
                           before=None if self._mirror is None else self._before)

    def _before(self, keep: int, ids: list[int], whole: bool) -> None:
        self._tell(("spec_run", keep, ids, whole))
        self._share()

    def step(self, spec: Speculation) -> list[TokenOutput]:
        """One step of ``spec`` (``Speculation.step``); its cache kept once it ends."""
        if self._mirror is None:
            outs = spec.step()
        else:
            with self._mirror.stepping():
                outs = spec.step()
        if outs and outs[-1].finish_reason is not None:
            self.end(spec, finished=True)
        return outs

    def join(self, spec: Speculation, gen: Any) -> int:
        """``spec`` joins mlx-lm's ``BatchGenerator`` ``gen``: its uid there."""
        sampler, shared = make_sampler(spec.params, self._vocab_size), False
        if self._mirror is not None:
            sampler, shared = self._mirror.sampler(sampler)
        uid = spec.join(gen, sampler)
        self._tell(("spec_join", uid, spec.offset, spec.pending, spec.left, shared))
        return uid

    def resume(self, gen: Any, uid: int, prompt: Sequence[int], params: SamplingParams,
               parked: Speculation | None) -> Speculation | None:
        """The sequence ``uid`` of ``gen`` (the batch's one sequence left, past its prompt)
        out of the batch, decoded speculatively again: its cache (the last token taken
        back out of it, to be the next pass's input; the token mlx-lm sampled ahead is
        dropped and drawn again) and its tokens, with the draft's cache and pacing it had
        when it joined (``parked``), if it speculated before. None, left in the batch,
        when its cache is not one speculation trims (``Speculation.trimmable``), and then
        for good (its cache is not copied out again each step)."""
        if uid == self._declined:  # the batch's lone sequence: the one asked each step
            return None
        [(cache, held)] = gen.extract_cache([uid]).values()
        tokens = list(held)
        if len(tokens) <= len(prompt) or int(cache[0].offset) != len(tokens) \
                or not all(type(c) in (KVCache, QuantizingKVCache) for c in cache):
            self._declined = uid
            return None
        gen.remove([uid])
        self._tell(("spec_back", uid))
        rewind(cache, len(tokens) - 1)
        spec = self._speculation(tokens, params, cache)
        spec.generated = len(tokens) - len(prompt)
        if parked is not None:
            spec.draft_cache, spec.pacing = parked.draft_cache, parked.pacing
        return spec

    def end(self, spec: Speculation, *, finished: bool) -> None:
        """``spec`` ended: finished, its cache goes into the prompt cache; else dropped."""
        if finished:
            self._prompt_cache.keep(*spec.held())
        self._tell(("spec_end", spec.offset if finished else None))


class Followed:
    """A follower's side (``Follower``): its slices' cache of the sequence rank 0 decodes
    speculatively, and the tokens in it."""

    def __init__(self, model: Any, tokens: list[int], cache: list[Any]) -> None:
        self._model = model
        self.cache = cache
        self.tokens = tokens

    @classmethod
    def start(cls, model: Any, prompt_cache: PromptCache, tokens: list[int], spared: int,
              kv_quant: KVQuant | None) -> Followed:
        """``spec``: from this rank's prompt cache, which must spare what rank 0's did;
        else a new cache of rank 0's kind (``kv_quant``: its setup op's)."""
        cache, rest = prompt_cache.fetch(tokens)
        if len(tokens) - len(rest) != spared:
            raise EngineError(f"this rank's prompt cache holds {len(tokens) - len(rest)} "
                              f"tokens of the speculating sequence's prompt, rank 0's "
                              f"{spared}")
        return cls(model, tokens, cache if cache is not None else
                   make_prompt_cache(model) if kv_quant is None
                   else quantizing_caches(model, kv_quant))

    @classmethod
    def back(cls, model: Any, gen: Any, uid: int) -> Followed:
        """``spec_back``: ``uid`` out of this rank's batch, as rank 0's ``Solo.resume``."""
        [(cache, held)] = gen.extract_cache([uid]).values()
        gen.remove([uid])
        return cls(model, list(held), cache)

    def trim(self, keep: int) -> None:
        """The cache back to its first ``keep`` tokens (rank 0's accepted ones)."""
        offset = int(self.cache[0].offset)
        if keep > offset:
            raise EngineError(f"rank 0 keeps {keep} tokens of the speculating sequence; "
                              f"this rank's cache holds {offset}")
        rewind(self.cache, keep)
        del self.tokens[keep:]

    def run(self, keep: int, ids: list[int], whole: bool) -> None:
        """Rank 0's next target pass (``spec_run``), on this rank's slices."""
        self.trim(keep)
        self.tokens += ids
        out = self._model(mx.array(ids, dtype=mx.uint32)[None], cache=self.cache)
        mx.eval(out if whole else [c.state for c in self.cache])

    def join(self, gen: Any, keep: int, pending: list[int], max_tokens: int,
             sampler: Any) -> int:
        """Into the follower's batch, as rank 0's ``Solo.join``: its uid there."""
        self.trim(keep)
        [uid] = gen.insert([pending], max_tokens=[max_tokens], caches=[self.cache],
                           all_tokens=[list(self.tokens)], samplers=[sampler])
        return int(uid)

    def end(self, prompt_cache: PromptCache, keep: int | None) -> None:
        if keep is not None:
            self.trim(keep)
            prompt_cache.keep(list(self.tokens), self.cache)
