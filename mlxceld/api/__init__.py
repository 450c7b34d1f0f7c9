"""The OpenAI-compatible HTTP layer of the router, shared by every engine.

Its names are loaded when first asked for (PEP 562): a process that needs only a light
part of this room (the daemon's own ``/metrics`` listener takes ``auth``, ``errors`` and
``metrics``) does not load the router's app, and through it mlx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxceld.api.app import build_router_app
    from mlxceld.api.codec import (
        CalledTool,
        ChatFeatures,
        ChatMessage,
        ChatRole,
        ChatTemplateError,
        MlxTextCodec,
        StreamDecoder,
        TextCodec,
    )
    from mlxceld.api.errors import ApiError, refusal_body
    from mlxceld.api.requests import ChatRequest, CompletionRequest, Options

_HOMES = {"build_router_app": "app", "CalledTool": "codec", "ChatFeatures": "codec",
          "ChatMessage": "codec", "ChatTemplateError": "codec", "MlxTextCodec": "codec",
          "ChatRole": "codec", "StreamDecoder": "codec", "TextCodec": "codec",
          "ApiError": "errors", "refusal_body": "errors", "ChatRequest": "requests",
          "CompletionRequest": "requests", "Options": "requests"}

__all__ = [
    "ApiError",
    "CalledTool",
    "ChatFeatures",
    "ChatMessage",
    "ChatRequest",
    "ChatRole",
    "ChatTemplateError",
    "CompletionRequest",
    "MlxTextCodec",
    "Options",
    "StreamDecoder",
    "TextCodec",
    "build_router_app",
    "refusal_body",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
