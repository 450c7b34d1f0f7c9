"""The grammar that forces tool calls: ``tool_choice`` "required" or a named function.

A Lark grammar in llguidance's dialect (``engine/constraints.py`` enforces it token by
token): the model's tool-call start marker, a JSON object ``{"name": <one of the allowed
tools>, "arguments": <that tool's parameters schema>}`` (llguidance's ``%json``), the end
marker; one call, or with ``parallel_tool_calls`` one or more. Once the grammar is
complete only end-of-sequence is allowed, so the answer ends there ("tool_calls").

The object is what mlx-lm's json_tools parser reads (Qwen, Hermes and the other
``<tool_call>{...}</tool_call>`` templates); for a model whose template calls tools in
another syntax (``json_object_calls`` is False) no grammar is made and forcing is refused.
When the prompt opens a reasoning block, the grammar first closes it: a forced answer has
no reasoning. A ``response_format`` after such a prompt is closed the same way
(``after_thinking``): the JSON is the answer's content, not its reasoning.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from mlxceld.api.codec import ChatFeatures
from mlxceld.api.errors import invalid
from mlxceld.api.tools.choice import Tool
from mlxceld.engine import Constraint
from mlxceld.engine.constraints import ConstraintError, compile_grammar

# Compact JSON in the call (llguidance's schema options): no room to pad with whitespace.
JSON_OPTIONS = {"whitespace_flexible": False}

# The parsers whose call is the JSON object above, between the markers.
JSON_CALL_MARKERS = ("<tool_call>", "</tool_call>")


def json_object_calls(features: ChatFeatures) -> bool:
    """Whether the model's tool calls are ``<tool_call>{"name", "arguments"}</tool_call>``."""
    return features.tool_call == JSON_CALL_MARKERS and features.parse_tool_call is not None \
        and getattr(features.parse_tool_call, "__module__", "") == "mlx_lm.tool_parsers.json_tools"


def tool_call_grammar(tools: Sequence[Tool], features: ChatFeatures, *, parallel: bool,
                      close_thinking: bool) -> str:
    """The Lark grammar of an answer that is only calls of ``tools`` (the offered ones)."""
    if not tools:
        raise ValueError("a forced tool call needs at least one tool")
    if features.tool_call is None:
        raise ValueError("the model has no tool-call markers")
    start, end = features.tool_call
    ids = dict(features.marker_ids)

    def marker(text: str) -> str:  # a one-token marker by its id: llguidance's special token
        return f"<[{ids[text]}]>" if text in ids else json.dumps(text)

    lines = []
    prefix = ""
    if close_thinking and features.think is not None:
        prefix = _closing(features)
    lines.append(f"start: {prefix}{'block+' if parallel else 'block'}")
    lines.append(f"block: {marker(start)} call {marker(end)}")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        schema = {"type": "object",
                  "properties": {"name": {"const": tool.name},
                                 "arguments": json.loads(tool.parameters)},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": JSON_OPTIONS}
        lines.append(f"call_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _closing(features: ChatFeatures) -> str:
    """The Lark that closes the reasoning block the prompt opened, as templates write it."""
    assert features.think is not None
    end = features.think[1]
    ids = dict(features.marker_ids)
    closing = f"<[{ids[end]}]>" if end in ids else json.dumps(end)
    return f"{closing} \"\\n\\n\" "


def after_thinking(constraint: Constraint, features: ChatFeatures) -> Constraint:
    """A ``response_format`` constraint for a prompt that opens a reasoning block: close
    the block first, then the JSON. Unchanged when the model has no reasoning markers."""
    if features.think is None or constraint.kind == "lark":
        return constraint
    schema = json.loads(constraint.text) if constraint.kind == "json_schema" \
        else {"type": "object"}
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    grammar = f"start: {_closing(features)}answer\nanswer: %json {json.dumps(schema)}\n"
    return Constraint("lark", grammar)


async def forced_constraint(tools: Sequence[Tool], features: ChatFeatures, *,
                            parallel: bool, close_thinking: bool) -> Constraint:
    """The constraint of a forced answer, compiled (in a thread: a large schema takes a
    while) so that a tool's schema llguidance cannot honour is refused before admission,
    as a 400 naming ``tools``."""
    constraint = Constraint("lark", tool_call_grammar(tools, features, parallel=parallel,
                                                      close_thinking=close_thinking))
    try:
        await asyncio.to_thread(compile_grammar, constraint)
    except ConstraintError as exc:
        raise invalid(f"the tools' parameters cannot force a tool call: {exc}", "tools",
                      "invalid_tools") from None
    return constraint
