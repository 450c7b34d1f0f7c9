"""What the local engine's step thread hands mlx-lm's ``BatchGenerator`` and takes back:
the generator itself (every rank of a tensor-parallel group builds it alike), a new
sequence's cache, a request's checks and constraint, its responses as ``TokenOutput``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mlx_lm.generate import BatchGenerator

from mlxceld.engine.base import FinishReason, SamplingParams, TokenOutput
from mlxceld.engine.constraints import Matching
from mlxceld.engine.kvquant import quantizing_caches
from mlxceld.engine.sampling import read_logprobs
from mlxceld.roles.options import KVQuant


def generator(model: Any, eos_token_ids: set[int], max_batch: int, prefill_step: int) -> Any:
    """The engine's mlx-lm ``BatchGenerator`` (every rank of a group builds it so)."""
    return BatchGenerator(  # mlx-lm is untyped here
        model, stop_tokens=[[t] for t in sorted(eos_token_ids)],
        completion_batch_size=max_batch, prefill_batch_size=max_batch,
        prefill_step_size=prefill_step,
    )


def fresh_cache(model: Any, kv_quant: KVQuant | None) -> list[Any] | None:
    """A new sequence's cache: quantizing with ``kv_quant``, else None (``BatchGenerator``
    makes mlx-lm's own)."""
    return None if kv_quant is None else quantizing_caches(model, kv_quant)


def output_of(params: SamplingParams, r: Any, reason: FinishReason | None) -> TokenOutput:
    """One of ``BatchGenerator``'s responses as a ``TokenOutput`` (its log-probabilities
    read only when the request asked for them)."""
    token = int(r.token)
    if params.logprobs is None:
        return TokenOutput(token, reason)
    logprob, top = read_logprobs(r.logprobs, token, params.logprobs)
    return TokenOutput(token, reason, logprob, top)


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """Every ``logit_bias`` token id inside the model's vocabulary (the API checked it
    against the tokenizer's, which may be larger than the model's logits)."""
    outside = [t for t, _ in params.logit_bias if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(f"logit_bias names token {outside[0]}, outside this model's "
                         f"vocabulary of {vocab_size} tokens")


def constraint_processors(matching: Matching | None) -> list[Callable[[Any, Any], Any]]:
    """A sequence's constraint as mlx-lm logits processors (kept apart from the sampling
    processors, so that the two lists are concatenated; the mask goes last)."""
    return [] if matching is None else [matching]


def put_all(items: list[tuple[asyncio.Queue[TokenOutput | BaseException], TokenOutput]]
             ) -> None:
    for out, item in items:
        out.put_nowait(item)
