"""A tool call's text, as the model wrote it, turned into OpenAI's ``tool_calls`` entries.

The model's own parser (mlx-lm's ``tool_parser`` for its template: json_tools, qwen3_coder,
mistral, ...) reads the text between the markers into ``{"name", "arguments"}`` (or a list
of them). Each becomes a ``ToolCall`` with a fresh ``call_`` id and its arguments as a JSON
object's text. Text the parser cannot read, or that reads as something other than calls,
is ``None``: the caller shows it as content (and it is logged), rather than failing the
answer or dropping it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxceld.api.codec import ToolParser

log = logging.getLogger(__name__)

SHOWN_CHARS = 200  # of an unparsable call, in the log


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text


def parse_calls(text: str, parser: ToolParser, tools: Sequence[Any] | None, *,
                request_id: str) -> list[ToolCall] | None:
    """The calls in ``text``, or None when it holds none the parser can read."""
    try:
        parsed = parser(text, list(tools) if tools else None)
    except Exception as exc:  # parsers raise ValueError, KeyError, IndexError, ...
        log.warning("request %s: a tool call the model's parser cannot read (%s: %s) is "
                    "returned as content: %r", request_id, type(exc).__name__, exc,
                    text[:SHOWN_CHARS])
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = [call for item in items if (call := _call(item)) is not None]
    if not calls or len(calls) != len(items):
        log.warning("request %s: a tool call without a name or with arguments that are not "
                    "an object is returned as content: %r", request_id, text[:SHOWN_CHARS])
        return None
    return calls


def _call(item: Any) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    name = item.get("name")
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):  # some parsers leave the JSON text as it was
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name,
                    json.dumps(arguments, ensure_ascii=False))
