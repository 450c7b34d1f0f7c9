"""The engine seam: what the shared router layer (mlxceld/api) asks of any engine.

Local (the model in-process), pipeline (stages over MXCL) and disaggregated
engines all implement ``Engine``; those over links to other nodes (pipeline stages,
replicas, prefill and decode nodes) ``LinkedEngine`` too, and a pool of them
``PoolEngine`` (the router worker keeps their links up: ``workers/engines.py``). Above
it, shared by all: OpenAI parsing, chat templates, tokenization, detokenization, stop
strings, streaming, admission and metrics. Below it: prefill, batched decode, sampling, caches.

Token ids cross this seam, never text: the pipeline's last stage returns ids.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mlxceld.wire.transport_messages import LOGPROB_FLOOR as LOGPROB_FLOOR  # -inf reads so

FinishReason = Literal["stop", "length"]
ConstraintKind = Literal["json_schema", "json_object", "lark"]


@dataclass(frozen=True)
class Constraint:
    """What the output must match, enforced token by token (``engine/constraints.py``):
    ``json_schema`` (``text`` is the schema as JSON), ``json_object`` (any JSON object;
    ``text`` is empty) or ``lark`` (``text`` is a Lark grammar in llguidance's dialect)."""

    kind: ConstraintKind
    text: str = ""


REPETITION_CONTEXT = 20  # tokens the repetition penalty looks back (mlx-lm's default)
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's bound)
MAX_TOP_LOGPROBS = 20  # alternatives one token may carry (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy (argmax).

    The logits processors (``engine/processors.py``) act on the model's logits, in this
    order: ``logit_bias`` (token id, added value: pairs sorted by id), the repetition
    penalty (1: off) over the last ``REPETITION_CONTEXT`` tokens of prompt and
    completion, then the presence and frequency penalties (0: off) over the tokens
    generated so far. The sampler then filters by ``top_k`` (0: off), ``top_p`` and
    ``min_p`` (0: off). ``logprobs``: None, or how many top alternatives each
    ``TokenOutput`` carries besides the chosen token's own log-probability (0 to
    ``MAX_TOP_LOGPROBS``). ``constraint``: the output must match it (None: free text);
    its mask acts after the other processors. ``min_tokens``: no end-of-sequence token
    is sampled before that many tokens were generated (vLLM's); ``ignore_eos``: none at
    all (llama.cpp's, vLLM's): the engine's processors mask them, so the sequence runs to
    ``max_tokens`` (or the router's stop strings)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None  # in [0, 2**64) (the API maps OpenAI's signed seed there)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    constraint: Constraint | None = None
    min_tokens: int = 0  # 0: end-of-sequence tokens from the first token on
    ignore_eos: bool = False

    @property
    def penalized(self) -> bool:
        """Whether any processor looks at the tokens before the one to sample."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_tokens: Sequence[int]
    params: SamplingParams


@dataclass(frozen=True)
class TokenOutput:
    """One generated token. ``finish_reason`` is set on the sequence's last output:
    "stop" when the token is an end-of-sequence token (it is not text to show),
    "length" when max_tokens was reached (the token is part of the output)."""

    token: int
    finish_reason: FinishReason | None = None
    # With ``SamplingParams.logprobs``: the token's log-probability (the log-softmax of the
    # processed logits, before temperature and the sampler's filters; never below
    # ``LOGPROB_FLOOR``) and the top alternatives, most likely first (ties by id).
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    # On a sequence's first output: how many of its prompt's tokens the engine took from a
    # prompt cache rather than prefilling them (None: the engine does not say). What the
    # engine says of the prompt, not of the token: outputs equal without it.
    cached: int | None = field(default=None, compare=False)


class EngineError(Exception):
    """The engine could not serve a request (it is the server's fault, not the client's)."""


class EngineUnavailable(EngineError):
    """A part of the engine (a pipeline stage) cannot be reached: HTTP 503, the part named
    (never by its address), with ``Retry-After: retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Engine(Protocol):
    """A running engine. ``generate`` streams one sequence's tokens; the caller's
    closing the iterator early (``aclose``, client gone) cancels the sequence and
    frees its cache. At most ``max_batch`` sequences are handed to it at once: the
    admission queue above it holds the rest."""

    @property
    def model_id(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    @property
    def max_batch(self) -> int: ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]: ...

    def active_sequences(self) -> int: ...

    async def aclose(self) -> None: ...


class LinkedEngine(Engine, Protocol):
    """An engine over links to other nodes: ``keep_linked`` keeps them up (runs until
    cancelled), ``rekey`` hands them the keyring's new keys, and ``readiness`` names what
    keeps it from serving well now (a JSON object with a ``message``; None: nothing)."""

    async def keep_linked(self) -> None: ...

    def rekey(self) -> None: ...

    def readiness(self) -> dict[str, Any] | None: ...


class PoolEngine(LinkedEngine, Protocol):
    """A pool of linked members (replicas, pipeline groups, prefill and decode nodes):
    ``stats`` is each member's load, health and counts, with their addresses only when
    ``verbose``."""

    def stats(self, *, verbose: bool) -> dict[str, Any]: ...
