"""Per-sequence samplers: greedy, or temperature with top-k / top-p / min-p and an own
seed; and the log-probabilities a token is reported with.

A sampler maps one sequence's log-probabilities ``[1, vocab]`` to a token id
``[1]``. A seeded sampler carries its own PRNG key, so a request with a seed
gets the same tokens whatever else shares its batch. ``min_p`` is mlx-lm's (a token
is kept when its probability is at least ``min_p`` times the top token's).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxceld.engine.base import LOGPROB_FLOOR, SamplingParams

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def sampling_logits(params: SamplingParams, vocab_size: int
                    ) -> Callable[[mx.array], mx.array]:
    """What a temperature sampler draws from (``categorical`` of it): log-probabilities
    ``[..., vocab]`` filtered by top-k, top-p and min-p, over the temperature, each row
    alone (``engine/speculative.py`` takes its softmax as the sampling distribution)."""
    temp = params.temperature
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    top_p = params.top_p
    min_p = params.min_p

    def scaled(logprobs: mx.array) -> mx.array:
        if top_k:
            logprobs = apply_top_k(logprobs, top_k)
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        return logprobs * (1.0 / temp)

    return scaled


def make_sampler(params: SamplingParams, vocab_size: int) -> Sampler:
    """The shared ``greedy`` for temperature 0 (so greedy batches sample in one call)."""
    if params.temperature == 0:
        return greedy
    scale = sampling_logits(params, vocab_size)
    key: list[mx.array | None] = [None if params.seed is None else mx.random.key(params.seed)]

    def sample(logprobs: mx.array) -> mx.array:
        scaled = scale(logprobs)
        if key[0] is None:
            return mx.random.categorical(scaled)
        key[0], sub = mx.random.split(key[0])
        # Evaluated now: the pipeline's last stage samples on its compute thread or its
        # event loop's, and a lazy key left by one is not runnable on the other (mlx:
        # "There is no Stream(cpu, 1) in current thread"); a split costs microseconds.
        mx.eval(key[0])
        return mx.random.categorical(scaled, key=sub)

    return sample


def read_logprobs(row: mx.array, token: int, top: int
                  ) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``token``'s log-probability in ``row`` (``[vocab]``) and the ``top`` most likely
    tokens with theirs, most likely first, ties by id; each at least ``LOGPROB_FLOOR``."""
    chosen = _bounded(float(row[token].item()))  # type: ignore[arg-type]  # a real
    if top <= 0:
        return chosen, ()
    top = min(top, row.shape[-1])
    ids = mx.argpartition(-row, kth=top - 1)[:top]
    id_list: list[int] = ids.tolist()  # type: ignore[assignment]  # 1-d: a list of ints
    values: list[float] = row[ids].astype(mx.float32).tolist()  # type: ignore[assignment]
    pairs = sorted(zip(id_list, values, strict=True), key=lambda p: (-p[1], p[0]))
    return chosen, tuple((int(i), _bounded(float(v))) for i, v in pairs)


def _bounded(logprob: float) -> float:
    """In [LOGPROB_FLOOR, 0]: -inf (a token a processor ruled out) reads as the floor."""
    return min(max(logprob, LOGPROB_FLOOR), 0.0)
