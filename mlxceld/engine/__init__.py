"""Engines: local (in-process model) now; pipeline and disaggregated later."""

from mlxceld.engine.base import (
    Engine,
    EngineError,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenOutput,
)

__all__ = ["Engine", "EngineError", "EngineUnavailable",
           "FinishReason", "GenerationRequest", "SamplingParams",
           "TokenOutput"]
