"""The engine seam: what the shared router layer (mlxceld/api) asks of any engine.

Local (the model in-process), pipeline (stages over MXCL) and disaggregated
engines all implement ``Engine``. Above it, shared by all: OpenAI parsing,
chat templates, tokenization, detokenization, stop strings, streaming,
admission and metrics. Below it: prefill, batched decode, sampling, caches.

Token ids cross this seam, never text: the pipeline's last stage returns ids.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]
ConstraintKind = Literal["json_schema", "json_object", "lark"]


@dataclass(frozen=True)
class Constraint:
    """What the output must match, enforced token by token (``engine/constraints.py``):
    ``json_schema`` (``text`` is the schema as JSON), ``json_object`` (any JSON object;
    ``text`` is empty) or ``lark`` (``text`` is a Lark grammar in llguidance's dialect)."""

    kind: ConstraintKind
    text: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy (argmax).
    ``constraint``: the output must match it (None: free text)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    constraint: Constraint | None = None


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

    model_id: str
    context_length: int
    max_batch: int

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]: ...

    def active_sequences(self) -> int: ...

    async def aclose(self) -> None: ...
