"""The OpenAI-compatible HTTP layer of the router, shared by every engine."""

from mlxceld.api.app import build_router_app
from mlxceld.api.codec import (
    CalledTool,
    ChatFeatures,
    ChatMessage,
    ChatTemplateError,
    MlxTextCodec,
    Role,
    StreamDecoder,
    TextCodec,
)
from mlxceld.api.errors import ApiError, refusal_body
from mlxceld.api.requests import ChatRequest, CompletionRequest, Options

__all__ = ["ApiError", "CalledTool", "ChatFeatures", "ChatMessage", "ChatRequest",
           "ChatTemplateError", "CompletionRequest", "MlxTextCodec", "Options", "Role",
           "StreamDecoder", "TextCodec", "build_router_app", "refusal_body"]
