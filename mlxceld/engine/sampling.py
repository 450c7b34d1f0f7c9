"""Per-sequence samplers: greedy, or temperature with top-k / top-p and an own seed.

A sampler maps one sequence's log-probabilities ``[1, vocab]`` to a token id
``[1]``. A seeded sampler carries its own PRNG key, so a request with a seed
gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlxceld.engine.base import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(params: SamplingParams, vocab_size: int) -> Sampler:
    """The shared ``greedy`` for temperature 0 (so greedy batches sample in one call)."""
    if params.temperature == 0:
        return greedy
    temp = params.temperature
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    top_p = params.top_p
    key: list[mx.array | None] = [None if params.seed is None else mx.random.key(params.seed)]
    if key[0] is not None:
        mx.eval(key[0])

    def sample(logprobs: mx.array) -> mx.array:
        if top_k:
            logprobs = apply_top_k(logprobs, top_k)
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        scaled = logprobs * (1.0 / temp)
        if key[0] is None:
            return mx.random.categorical(scaled)
        key[0], sub = mx.random.split(key[0])
        # Evaluated now: a pipeline stage samples on its compute thread or its event loop's,
        # and a lazy key made on one fails on the other ("no Stream(cpu, 1) in current
        # thread"); an evaluated one is plain data.
        mx.eval(key[0])
        return mx.random.categorical(scaled, key=sub)

    return sample
