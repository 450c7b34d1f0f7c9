"""A request continued elsewhere after some of its tokens were sent: what another engine
(a healed plan's, another replica) is given, and whether it can continue exactly.

``remainder(request, sent)`` is the request whose prompt is the old prompt followed by the
tokens ``sent`` to the client, with ``max_tokens`` and ``min_tokens`` less those: prefilled
as one prompt, then decoded on, it gives the client one answer with no token repeated or
lost. What depends only on the text so far continues exactly: greedy (temperature 0),
unseeded sampling (a draw from the same distribution), ``logit_bias``,
top-k/top-p/min-p, the repetition penalty (its window is the last ``REPETITION_CONTEXT``
tokens of prompt and completion, which the new prompt carries), log-probabilities (each
token's from the engine that produced it), ``ignore_eos``. What the first engine kept of
the tokens it generated cannot be handed on: the presence and frequency penalties
(counted over the generated tokens only), a constraint's matcher state (a JSON schema, a
grammar) and a seeded sampler's random stream; ``replayable`` is False for such a request
once it has sent tokens (before its first token any request can start again elsewhere).

``Continuity`` counts what became of such requests at one router, for ``/metrics``
(``api/edge/metrics.py``): held now for a working plan (``pipeline/replay.py``), held in
all, replayed (on a healed plan, on stages back, on the current plan after a live move),
lost (no working plan within the hold, or not replayable), continued on another replica
(``replicas/pool.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from mlxceld.engine.base import GenerationRequest, SamplingParams


def replayable(params: SamplingParams, sent: int) -> bool:
    """Whether a request that sent ``sent`` tokens can be continued elsewhere exactly (the
    module's doc says why)."""
    if not sent:
        return True
    return (params.presence_penalty == 0 and params.frequency_penalty == 0
            and params.constraint is None
            and (params.seed is None or params.temperature == 0))


def remainder(request: GenerationRequest, sent: list[int]) -> GenerationRequest:
    """The request that continues ``request`` after the tokens ``sent``: those prefilled
    after its prompt, the token bounds less them."""
    if not sent:
        return request
    params = request.params
    return replace(request, prompt_tokens=[*request.prompt_tokens, *sent],
                   params=replace(params, max_tokens=params.max_tokens - len(sent),
                                  min_tokens=max(0, params.min_tokens - len(sent))))


@dataclass
class Continuity:
    """A router's counts of requests continued elsewhere (the module's doc)."""

    held: int = 0  # held now, waiting for a working plan
    held_total: int = 0
    replayed_total: int = 0
    lost_total: int = 0
    continued_total: int = 0  # on another replica of a pool

    def __add__(self, other: Continuity) -> Continuity:
        return Continuity(*(getattr(self, f.name) + getattr(other, f.name)
                            for f in fields(self)))
