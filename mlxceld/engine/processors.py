"""Per-sequence logits processors: logit bias and the penalties, from mlx-lm's pieces.

A processor maps ``(tokens, logits)`` to logits: ``tokens`` is an int32 ``mx.array`` of
the sequence's history up to the token about to be sampled, ``logits`` the model's raw
logits ``[1, vocab]`` in the model's dtype. Both engines call them the same way: the
local engine through mlx-lm's ``BatchGenerator`` (its history: the whole prompt, then
what was generated), the pipeline's last stage itself (its history: the prompt's last
``base.REPETITION_CONTEXT`` tokens, sent in ``prepare`` when the repetition penalty is
on, then what it sampled). Every processor therefore reads no further back than both
histories reach, and the two engines give the same tokens.

What each control means here (the seam's choices, as vLLM and OpenAI users expect):

- ``logit_bias``: added to the logits (OpenAI: -100 to 100; +100 forces the token,
  -100 bans it in practice).
- ``presence_penalty``, ``frequency_penalty``: OpenAI's, over the tokens *generated* so
  far (all of them, not the prompt's): a token's logit loses the presence penalty once if
  it was generated, and the frequency penalty once per time it was.
- ``repetition_penalty`` (vLLM's and mlx-lm's name; > 0, 1 is off): mlx-lm's sign-aware
  multiplicative penalty over the last ``base.REPETITION_CONTEXT`` tokens of prompt and
  completion together (mlx-lm's default window, as ``mlx_lm.server`` applies it).
- ``min_tokens``, ``ignore_eos`` (vLLM's, llama.cpp's): the end-of-sequence tokens' logits
  are -inf while fewer than ``min_tokens`` tokens were generated (always, with
  ``ignore_eos``), so the engine, which ends a sequence on one, goes on. Last of the
  processors, before a grammar's mask (the router refuses both with a constraint).

Processors are stateful (they count the tokens generated): one list per sequence, called
once for each token sampled, in order. Another processor (a grammar's mask) may be
appended to the list ``make_logits_processors`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)
from mlx_lm.sample_utils import make_logits_processors as mlx_lm_processors

from mlxceld.engine.base import REPETITION_CONTEXT, SamplingParams

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def make_logits_processors(params: SamplingParams, eos_token_ids: Iterable[int]
                           ) -> list[LogitsProcessor]:
    """The processors ``params`` asks for, in the order of ``SamplingParams``'s docstring;
    empty when it asks for none (the engines then skip the per-sequence path).
    ``eos_token_ids``: the model's end-of-sequence tokens, which ``min_tokens`` and
    ``ignore_eos`` hold back."""
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors += mlx_lm_processors(logit_bias=dict(params.logit_bias))
    if params.repetition_penalty != 1:
        processors.append(make_repetition_penalty(params.repetition_penalty,
                                                  REPETITION_CONTEXT))
    if params.presence_penalty != 0:
        processors.append(_on_generated(make_presence_penalty(params.presence_penalty,
                                                              params.max_tokens)))
    if params.frequency_penalty != 0:
        processors.append(_on_generated(make_frequency_penalty(params.frequency_penalty,
                                                               params.max_tokens)))
    eos = sorted(set(eos_token_ids))
    if eos and (params.ignore_eos or params.min_tokens > 0):
        processors.append(_holding_eos(eos, None if params.ignore_eos else params.min_tokens))
    return processors


def _holding_eos(eos: list[int], until: int | None) -> LogitsProcessor:
    """Mask the ``eos`` tokens while fewer than ``until`` tokens were generated (None:
    always): each call samples one token, so ``calls`` were generated before it."""
    calls = 0

    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        calls += 1
        if until is not None and calls > until:
            return logits
        inside = [t for t in eos if t < logits.shape[-1]]
        logits[:, mx.array(inside, dtype=mx.int32)] = -mx.inf
        return logits

    return run


def _on_generated(processor: Any) -> LogitsProcessor:
    """``processor`` over the generated tokens only: the last ``n`` of the history at its
    ``n``-th call (each call samples one token, so ``n`` were generated before it)."""
    calls = 0

    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        generated = tokens[len(tokens) - calls:] if calls else tokens[:0]
        calls += 1
        out: mx.array = processor(generated, logits)
        return out

    return run
