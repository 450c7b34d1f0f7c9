"""Speculative decoding in the local engine: a draft model proposes ``k`` tokens, the
target checks them in one pass and keeps the run it agrees with.

When it is on (``LocalEngine`` with a ``Draft``, ``[serve] draft_model``): for a sequence
that arrives while the engine holds no other, whose request the target alone would serve
the same way without per-step state (``Draft.takes``: no logits processors (logit_bias,
penalties, min_tokens, ignore_eos), no constraint, no seed with a temperature above 0: a
seeded sequence's tokens must not depend on what else is running), and whose cache can be
trimmed. Such a sequence is decoded here, outside mlx-lm's ``BatchGenerator``, one
``Speculation.step`` at a time: a prefill chunk (target and draft), or one pass. The
moment another sequence arrives, it joins the batch (``Speculation.join``: its cache
and the tokens not yet in it, as a prompt-cache hit joins it) and decodes batched. When
the batch is down to one sequence that may speculate (the rule above), past its prompt,
it leaves the batch and speculates again (``engine/solo.py``'s ``Solo.resume``: its cache
from the batch, the draft's cache and pacing it had, if it speculated before). Everything
else is plain batched decoding.

One pass (mlx-lm's ``speculative_generate_step``, the same verify and trim): the draft
proposes ``d_1..d_k`` from the last token; the target runs the tokens not yet in its
cache plus the proposals in one forward pass, which gives its distribution at each of
the k+1 positions; ``n`` proposals are accepted and one more token comes from the target
(``d_1..d_n, t``: between 1 and k+1 tokens a pass); both caches are trimmed back to
the tokens kept. Accepting:

- greedy (temperature 0): ``d_i`` while it is the target's argmax; ``t`` the target's
  argmax after them: exactly the target's own greedy tokens (``accept_greedy``), up to
  floating point: a pass over k+1 positions sums in another order than one over one
  position, so in bfloat16 a near-tie may break the other way (as in mlx-lm's). The draft
  proposes its own argmax read the same way, on log-probabilities (``propose``): two
  models with the same logits then break bfloat16's ties alike.
- temperature above 0: the standard rejection rule (Leviathan et al., Chen et al.):
  ``d_i`` (drawn from the draft's distribution ``q``) with probability ``min(1, p/q)``
  at it, where ``p`` is the target's; at the first rejection ``t`` is drawn from
  ``norm(max(0, p - q))``, after k acceptances from ``p`` (``accept_sampled``). ``p``
  and ``q`` are the sampler's own distributions, top-k, top-p, min-p and temperature
  applied (``sampling.sampling_logits``), so each token is distributed as the target
  alone would sample it.

A sequence whose proposals do not pay (measured: its tokens per second with proposals
and without) stops proposing for a while, longer each time (``engine/pacing.py``).

With a quantized KV cache (``[serve] kv_bits``, ``kv_quant``) the target's cache is the
batch's kind from the start (``engine/kvquant.py``'s ``QuantizingKVCache`` per layer, a
prompt-cache prefix as kept), so that it joins the batch and is kept in the prompt cache
as every other sequence's; the draft's stays plain (it only proposes, the target decides
what is kept, and a draft's cache is small). mlx-lm's ``QuantizedKVCache`` quantizes each
token's key and value rows alone (groups along the head dimension, never across tokens)
and ``trim`` only moves its offset, the rows past it overwritten by the next store: a
cache trimmed back holds exactly what one that never held the trimmed tokens would, and
one pass over k+1 positions stores what k+1 one-token steps would. What differs with
``quantized_kv_start`` above 0 is when a cache turns quantized: a one-token step finds it
so once it holds ``start`` tokens, so a pass does not run past that position at full
precision (``plain_room`` bounds its proposals). Greedy tokens and logprobs are those
without a draft with the same ``kv_bits``, token for token (on mlx's CPU backend, bit for
bit: tests/engine/test_speculative.py).

Logprobs are the target's (the log-softmax of its logits at each kept position), as
without a draft. The counters (``SpeculationStats``): tokens proposed and accepted, the
passes with proposals and the tokens they gave, for ``/metrics`` and ``mlxctl status``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from mlxceld.engine.base import FinishReason, SamplingParams, TokenOutput
from mlxceld.engine.kvquant import QuantizingKVCache, quantizing_caches
from mlxceld.engine.pacing import Pacing
from mlxceld.engine.sampling import Sampler, read_logprobs, sampling_logits
from mlxceld.roles.options import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, KVQuant

# Told before each of the target's forward passes: how many tokens its cache keeps (it
# is trimmed to them first), the ids the pass runs, and whether its logits are read
# (a pass: True) or only its cache filled (a prefill chunk): a tensor-parallel group's
# other ranks run the same pass (``engine/solo.py``).
Before = Callable[[int, list[int], bool], None]


@dataclass
class SpeculationStats:
    """Counters since the engine started: draft tokens proposed and accepted, target
    passes, and the tokens those passes gave."""

    proposed: int = 0
    accepted: int = 0
    passes: int = 0
    tokens: int = 0

    def to_json(self) -> dict[str, float]:
        return {"proposed": self.proposed, "accepted": self.accepted, "passes": self.passes,
                "tokens": self.tokens,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "tokens_per_pass": self.tokens / self.passes if self.passes else 0.0}


class Draft:
    """The draft model and ``k``, shared by every speculating sequence of one engine."""

    def __init__(self, model: Any, k: int = DEFAULT_DRAFT_TOKENS) -> None:
        if not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], not {k}")
        self.model = model
        self.k = k
        self.stats = SpeculationStats()
        self._lock = threading.Lock()

    def takes(self, params: SamplingParams, has_constraint: bool) -> bool:
        """Whether a sequence with ``params`` may speculate (the module docstring's rule,
        less the engine's part: alone, a trimmable cache)."""
        return not (has_constraint or params.logit_bias or params.penalized
                    or params.min_tokens or params.ignore_eos
                    or (params.temperature > 0 and params.seed is not None))

    def count(self, proposed: int, accepted: int, tokens: int) -> None:
        with self._lock:
            s = self.stats
            s.proposed, s.accepted = s.proposed + proposed, s.accepted + accepted
            s.passes, s.tokens = s.passes + 1, s.tokens + tokens

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return self.stats.to_json()


def accept_greedy(targets: Sequence[int], drafted: Sequence[int]) -> int:
    """How many of ``drafted`` the target's argmax tokens ``targets`` (one more) agree with,
    from the first on."""
    n = 0
    while n < len(drafted) and drafted[n] == targets[n]:
        n += 1
    return n


def accept_sampled(p: mx.array, q: mx.array, drafted: Sequence[int],
                   uniforms: mx.array) -> tuple[int, int]:
    """The rejection rule: ``p`` the target's distributions ``[k+1, V]``, ``q`` the draft's
    ``[k, V]`` (``drafted[i]`` drawn from ``q[i]``), ``uniforms`` ``k+1`` draws in [0, 1):
    ``d_i`` is accepted while ``uniforms[i] < p[i, d_i] / q[i, d_i]``; the token after
    them is drawn (inverse CDF, with ``uniforms[k]``) from ``norm(max(0, p - q))`` at the
    first rejection, else from ``p[k]``. Returns (accepted, that token)."""
    k = len(drafted)
    if k:
        rows = mx.arange(k)
        ids = mx.array(list(drafted), dtype=mx.int32)
        ratio = p[rows, ids] / q[rows, ids]
        rejected: list[bool] = (uniforms[:k] >= ratio).tolist()  # type: ignore[assignment]
        n = next((i for i, r in enumerate(rejected) if r), k)
    else:
        n = 0
    dist = p[n] if n == k else mx.maximum(p[n] - q[n], 0.0)
    cdf = mx.cumsum(dist)
    token = int(mx.sum(cdf <= uniforms[k] * cdf[-1]).item())  # type: ignore[arg-type]
    return n, min(token, int(dist.shape[0]) - 1)


class Speculation:
    """One sequence decoded speculatively: its target and draft caches and its tokens."""

    def __init__(self, draft: Draft, model: Any, tokens: Sequence[int], params: SamplingParams,
                 *, vocab_size: int, eos_token_ids: set[int], prefill_step: int, stream: Any,
                 cache: list[Any] | None = None, kv_quant: KVQuant | None = None,
                 before: Before | None = None) -> None:
        """``cache``: the target's for a prefix of ``tokens`` (the prompt cache's), else
        a new one, quantizing with ``kv_quant`` as the batch's are; ``stream``: mlx's
        stream to compute on (the batch's); ``before``: told of each of the target's
        forward passes before it runs (``Before``)."""
        self.draft, self.model, self.params = draft, model, params
        self.tokens = list(tokens)
        self.generated = 0
        self.pacing = Pacing(draft.k)  # when it proposes, and when not (engine/pacing.py)
        self.cached = 0 if cache is None else int(cache[0].offset)  # from the prompt cache
        self._stream = stream
        self.cache = cache if cache is not None else make_prompt_cache(model) \
            if kv_quant is None else quantizing_caches(model, kv_quant)
        self.draft_cache = make_prompt_cache(draft.model)
        self._eos = eos_token_ids
        self._prefill_step = prefill_step
        self._before = before
        self._scale: Callable[[mx.array], mx.array] | None = None if params.temperature == 0 \
            else sampling_logits(params, vocab_size)

    @staticmethod
    def trimmable(model: Any, draft: Draft) -> bool:
        """Whether both models keep plain ``KVCache`` layers, which trim back at any length,
        quantizing (``kv_bits``) or not (a sliding window's ``RotatingKVCache`` says it
        can while it has not wrapped)."""
        return all(type(c) is KVCache for m in (model, draft.model)
                   for c in make_prompt_cache(m))

    @property
    def offset(self) -> int:
        return int(self.cache[0].offset)

    def join(self, gen: Any, sampler: Sampler) -> int:
        """Hand this sequence to mlx-lm's ``BatchGenerator`` ``gen`` (its uid there), to be
        sampled with ``sampler``: the target's cache, the tokens in it, the rest
        (``pending``) as its prompt."""
        [uid] = gen.insert([self.pending], max_tokens=[self.left],
                           caches=[self.cache], all_tokens=[self.tokens[: self.offset]],
                           samplers=[sampler], logits_processors=[[]])
        return int(uid)

    @property
    def pending(self) -> list[int]:
        """The tokens not yet in the target's cache (the last one, between passes)."""
        return self.tokens[self.offset:]

    @property
    def left(self) -> int:
        """How many more tokens it may generate (``max_tokens`` less those it did)."""
        return self.params.max_tokens - self.generated

    def held(self) -> tuple[list[int], list[Any]]:
        """The tokens in the target's cache, and the cache (for the prompt cache)."""
        return self.tokens[: self.offset], self.cache

    def step(self) -> list[TokenOutput]:
        """One prefill chunk of either model (nothing emitted), else one pass. The draft
        is left behind while the pacing runs plain passes, and catches up on its next
        proposal (``propose`` reads every token its cache lacks)."""
        with mx.stream(self._stream):
            if self._prefill(self.model, self.cache) | (
                    self.pacing.k() > 0 and self._prefill(self.draft.model, self.draft_cache)):
                return []
            return self._pass()

    def _prefill(self, model: Any, cache: list[Any]) -> bool:
        start = int(cache[0].offset)
        n = min(self._prefill_step, len(self.tokens) - start - 1)
        if n <= 0:
            return False
        if model is self.model and self._before is not None:
            self._before(start, self.tokens[start:start + n], False)
        model(mx.array(self.tokens[start:start + n])[None], cache=cache)
        mx.eval([c.state for c in cache])
        return True

    def _pass(self) -> list[TokenOutput]:
        began = time.perf_counter()
        left = self.params.max_tokens - self.generated
        k = min(self.pacing.k(), left - 1, plain_room(self.cache, len(self.tokens)))
        drafted, q = self._propose(k)
        before, start = len(self.tokens), self.offset
        ids = mx.concatenate([mx.array(self.tokens[start:], dtype=mx.uint32), *drafted])
        if self._before is not None:
            self._before(start, ids.tolist(), True)  # type: ignore[arg-type]
        logits = self.model(ids[None], cache=self.cache)[0, -(k + 1):, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        proposed: list[int] = mx.concatenate(drafted).tolist() if k else []  # type: ignore[assignment]
        n, last = accept(logprobs, proposed, q, self._scale)
        out = self._emit([*proposed[:n], last], logprobs)
        if k:
            self.draft.count(k, n, len(out))
        kept = len(self.tokens) - 1  # the last token is the next pass's input
        rewind(self.cache, min(before + n, kept))
        rewind(self.draft_cache, min(int(self.draft_cache[0].offset), before + min(n, k - 1),
                                      kept))
        self.pacing.record(len(out), time.perf_counter() - began)
        return out

    def _propose(self, k: int) -> tuple[list[mx.array], list[mx.array]]:
        """``k`` draft tokens (each ``[1]``, lazy) and, sampling, the draft's
        distributions they were drawn from."""
        y = mx.array(self.tokens[int(self.draft_cache[0].offset):], dtype=mx.uint32)
        return propose(self.draft.model, y, self.draft_cache, k, self._scale)

    def _emit(self, tokens: list[int], logprobs: mx.array) -> list[TokenOutput]:
        """``tokens`` as outputs, up to the first end-of-sequence token or max_tokens; the
        first output of all says what the prompt cache gave (``TokenOutput.cached``)."""
        out: list[TokenOutput] = []
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            self.generated += 1
            reason: FinishReason | None = "stop" if token in self._eos else \
                "length" if self.generated >= self.params.max_tokens else None
            asked = self.params.logprobs
            logprob, top = (None, ()) if asked is None else read_logprobs(logprobs[i], token,
                                                                          asked)
            cached = self.cached if self.generated == 1 else None
            out.append(TokenOutput(token, reason, logprob, top, cached=cached))
            if reason is not None:
                break
        return out


def propose(model: Any, y: mx.array, cache: list[Any], k: int,
            scale: Callable[[mx.array], mx.array] | None
            ) -> tuple[list[mx.array], list[mx.array]]:
    """``k`` tokens the draft ``model`` proposes after ``y`` (the tokens not yet in its
    ``cache``), each ``[1]`` and lazy, greedy when ``scale`` is None; else sampled, with
    the distributions (``scale``: the sampler's, on log-probabilities) they came from."""
    drafted: list[mx.array] = []
    dists: list[mx.array] = []
    for _ in range(k):
        logits = model(y[None], cache=cache)[0, -1:, :]
        # log-probabilities, as the target's are read (``accept``): in bf16 two logits a
        # ulp apart can round to one log-probability, and argmax then takes the first of
        # them; on raw logits the draft would pick the other, a proposal the target
        # rejects though both models' logits are the same
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if scale is None:
            y = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        else:
            scaled = scale(logprobs)
            dists.append(mx.softmax(scaled.astype(mx.float32), axis=-1)[0])
            y = mx.random.categorical(scaled).astype(mx.uint32)
        mx.async_eval(y)  # type: ignore[no-untyped-call]
        drafted.append(y)
    return drafted, dists


def accept(logprobs: mx.array, proposed: list[int], q: list[mx.array],
           scale: Callable[[mx.array], mx.array] | None) -> tuple[int, int]:
    """How many of ``proposed`` a pass keeps, and the target's token after them, from the
    target's ``logprobs`` [k+1, V]: greedy when ``scale`` is None, else the rejection rule
    over the sampler's distributions (``q``: the draft's)."""
    if scale is None:
        targets: list[int] = mx.argmax(logprobs, axis=-1).tolist()  # type: ignore[assignment]
        n = accept_greedy(targets, proposed)
        return n, targets[n]
    p = mx.softmax(scale(logprobs).astype(mx.float32), axis=-1)
    return accept_sampled(p, mx.stack(q) if q else p[:0], proposed,
                          mx.random.uniform(shape=(len(proposed) + 1,)))


def plain_room(cache: list[Any], length: int) -> int:
    """How many proposals a pass may add to a sequence of ``length`` tokens, the target's
    ``cache`` trimmed to its first ``length - 1`` as the pass begins: none at a position
    that a one-token step would store quantized while this pass stores it at full
    precision (a ``QuantizingKVCache`` not yet quantized, ``kv.start`` above
    ``length - 1``: the pass must end before ``kv.start``); else no bound."""
    first = cache[0]
    if not isinstance(first, QuantizingKVCache) or first.quantized \
            or length - 1 >= first.kv.start:
        return MAX_DRAFT_TOKENS
    return max(0, first.kv.start - length)


def rewind(cache: list[Any], keep: int) -> None:
    """Trim ``cache`` to its first ``keep`` tokens."""
    extra = int(cache[0].offset) - keep
    if extra > 0:
        trim_prompt_cache(cache, extra)
