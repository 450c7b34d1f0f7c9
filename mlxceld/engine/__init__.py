"""Engines: the seam the router's API drives (``base``) and the local, in-process engine
(``local``); the pipeline engine over stages on other hosts is ``mlxceld.pipeline``."""

from mlxceld.engine.base import (
    LOGPROB_FLOOR,
    MAX_TOP_LOGPROBS,
    Constraint,
    ConstraintKind,
    Engine,
    EngineError,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    LinkedEngine,
    PoolEngine,
    SamplingParams,
    TokenOutput,
)

__all__ = ["LOGPROB_FLOOR", "MAX_TOP_LOGPROBS", "Constraint", "ConstraintKind", "Engine",
           "EngineError", "EngineUnavailable", "FinishReason", "GenerationRequest",
           "LinkedEngine", "PoolEngine", "SamplingParams", "TokenOutput"]
