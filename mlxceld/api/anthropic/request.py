"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` bodies (Anthropic's Messages
API), read, checked and translated into the ``ChatRequest`` every chat endpoint serves
(``chatting.py``).

Each field is honoured, accepted as what it is (an opaque label, a cache hint), or
refused by name (400 ``invalid_request_error``); a field no table of
``anthropic/surface.py`` knows is refused by name too, or, with ``[serve] unknown_fields =
"warn"``, ignored and named (``ignoring.py``), as on every endpoint. What each becomes:

- ``model``: required; the served model's id, else 404 ``not_found_error``.
- ``max_tokens``: required, >= 1. A bound, as Anthropic's newer models take it: what is
  left of the context (or the operator's ``[serve] max_tokens``) when fewer; an answer cut
  by the context ends with ``model_context_window_exceeded`` (``anthropic/format.py``).
- ``system``: a string or text blocks, the first system message. A text block that is
  Claude Code's per-request billing line (``x-anthropic-billing-header: ...``) is left
  out: it is no instruction, and it changes every request, so the prompt cache would
  never see the same prefix twice (llama.cpp pull request 20623 drops it the same way).
- ``messages`` (read by ``anthropic/blocks.py``): user, assistant (and system) turns;
  content a string or blocks. Text
  blocks are joined with newlines. A user's ``tool_result`` block is a ``tool`` message
  (its content a string or text blocks; ``is_error`` true puts "Error: " before it); an
  assistant's ``tool_use`` block is a tool call of that message, ``thinking`` blocks its
  reasoning (the chat template decides whether earlier reasoning is shown);
  ``redacted_thinking`` blocks are dropped (their data is Anthropic's encryption, nothing
  a local model reads). Images, documents and server tools' blocks are refused by name.
  A last assistant message (Anthropic's "prefill") is refused: the chat template opens a
  new answer rather than continuing it.
- ``cache_control`` (on the request, a block, a tool): accepted; the prompt cache here is
  automatic (``[serve] prompt_cache_bytes``) and reuses any shared prefix.
- ``stop_sequences`` (at most ``MAX_STOP_SEQUENCES``), ``temperature`` (0 to 1),
  ``top_p``, ``top_k`` (0: off): honoured.
- ``tools``: custom tools (``name``, ``description``, ``input_schema``, ``type``
  "custom"); Anthropic's server tools (``web_search_...``, ``bash_...``) are refused by
  type. ``tool_choice``: auto, any (at least one call, forced by a grammar), tool (that
  one), none; ``disable_parallel_tool_use`` ends the answer after its first call.
- ``thinking``: ``enabled`` or ``adaptive`` render the template with
  ``enable_thinking`` true, ``disabled`` (or none) with false (Qwen3-style templates read
  it; others answer as they always do). ``budget_tokens`` becomes the effort (under 4096
  low, under 16384 medium, else high): no template bounds reasoning in tokens, and the
  reasoning counts against ``max_tokens`` as Anthropic's does. ``display`` "omitted"
  sends thinking blocks with empty text. ``output_config.effort`` sets the effort itself
  (xhigh and max read as high). The effort reaches the template as every chat's does
  (``reasoning.template_kwargs``: as ``reasoning_effort``); the one difference from chat,
  Anthropic's: thinking is off unless the request turns it on, and this switch wins.
- ``context_management``: ``clear_thinking_20251015`` edits are honoured (``keep`` "all",
  or ``{"type": "thinking_turns", "value": N}``: the reasoning of all but the last N
  assistant turns is dropped); other edits are refused.
- ``metadata.user_id``, ``user_profile_id``, ``workspace_id`` (labels), ``service_tier``
  ("auto", "standard_only": one tier here), ``speed`` "standard": accepted, nothing to do.
- Headers (``anthropic-version``, ``anthropic-beta``) are accepted: they select
  Anthropic's API versions and betas, and this server speaks one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mlxceld.api.anthropic.blocks import system_messages, turn_messages
from mlxceld.api.anthropic.surface import (
    CONTEXT_MANAGEMENT_FIELDS,
    COUNT_FIELDS,
    MESSAGES_FIELDS,
    METADATA_FIELDS,
    OUTPUT_CONFIG_FIELDS,
    THINKING_FIELDS,
    TOOL_CHOICE_FIELDS,
    TOOL_FIELDS,
)
from mlxceld.api.codec import ChatMessage
from mlxceld.api.errors import ApiError, invalid
from mlxceld.api.fields import Fields, check_text, member, parse_object, show
from mlxceld.api.reasoning import ABOVE_HIGH, read_effort
from mlxceld.api.requests import MAX_STOP_CHARS, OPENAI_DEFAULTS, ChatRequest, Options
from mlxceld.api.surface import check_fields
from mlxceld.api.tools.choice import ChoiceKind, Tool, ToolUse, parse_tools
from mlxceld.models.generation import SamplingDefaults

MAX_STOP_SEQUENCES = 16
MAX_TOOLS = 256
NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # Anthropic's rule for a tool's name
BUDGET_EFFORTS = ((4096, "low"), (16384, "medium"))  # thinking.budget_tokens under each
EFFORTS = ("low", "medium", "high", *ABOVE_HIGH)  # output_config.effort's


@dataclass(frozen=True)
class MessagesRequest:
    """A Messages body as a chat. ``chat.options.max_tokens`` is None: ``max_tokens``
    bounds the answer once the prompt's length is known; ``show_thinking``: false when
    ``thinking.display`` is "omitted"."""

    chat: ChatRequest
    max_tokens: int
    show_thinking: bool = True


def parse_messages(body: bytes, *, model_id: str, count: bool = False,
                   aliases: Collection[str] = (),
                   defaults: SamplingDefaults = OPENAI_DEFAULTS,
                   ignored: list[str] | None = None) -> MessagesRequest:
    """A ``/v1/messages`` body (``count``: a ``count_tokens`` body, which has no
    ``max_tokens`` and no sampling). ``aliases``: the model's other names (the answer's
    ``model`` is the one asked); ``defaults``: the sampling a request leaves out (the
    model's ``generation_config.json``); ``ignored``: unknown fields are ignored, their
    paths put there, rather than refused (``[serve] unknown_fields = "warn"``). Raises
    ``ApiError`` naming the field at fault."""
    obj = parse_object(body)
    check_fields(obj, COUNT_FIELDS if count else MESSAGES_FIELDS, ignored=ignored)
    fields = Fields(obj)
    model = fields.string("model")
    if model is None:
        raise invalid("'model' is required", "model")
    if model != model_id and model not in aliases:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{model_id!r} (see GET /v1/models; Claude Code: set ANTHROPIC_MODEL "
                       "and ANTHROPIC_DEFAULT_HAIKU_MODEL to it)", param="model",
                       code="model_not_found")
    max_tokens = 1 if count else fields.integer("max_tokens", 1)
    if max_tokens is None:
        raise invalid("'max_tokens' is required: the most tokens the answer may have",
                      "max_tokens")
    messages = [*system_messages(fields, ignored), *turn_messages(fields, ignored)]
    thinking, effort, show_thinking = _thinking(fields, ignored)
    messages = _clear_thinking(messages, _keep_thinking(fields, ignored))
    stream = False if count else fields.boolean("stream", False)
    if not count:
        _metadata(fields, ignored)
    options = Options(model=model, max_tokens=None,
                      temperature=fields.number("temperature", defaults.temperature, 0.0,
                                                1.0),
                      top_p=fields.number("top_p", defaults.top_p, 0.0, 1.0,
                                          low_open=True),
                      top_k=_or(fields.integer("top_k", 0), defaults.top_k),
                      min_p=defaults.min_p, repetition_penalty=defaults.repetition_penalty,
                      stop=_stops(fields), stream=stream)
    chat = ChatRequest(tuple(messages), options, _tool_use(fields, ignored),
                       (("enable_thinking", thinking),), effort)
    return MessagesRequest(chat, max_tokens, show_thinking)


def _tool_use(fields: Fields, ignored: list[str] | None) -> ToolUse | None:
    tools = parse_tools(fields, lambda item, path: _tool(item, path, ignored), "name",
                        MAX_TOOLS)
    names = [t.name for t in tools]
    choice: ChoiceKind = "auto"
    function = None
    parallel = True
    spec = fields.object("tool_choice")
    if spec is not None:
        check_fields(spec, TOOL_CHOICE_FIELDS, "tool_choice", ignored)
        inner = Fields(spec, "tool_choice")
        kind = inner.string("type")
        kinds: dict[str | None, ChoiceKind] = {"auto": "auto", "any": "required",
                                               "tool": "function", "none": "none"}
        if kind not in kinds:
            raise invalid("'tool_choice.type' must be auto, any, tool or none, not "
                          f"{show(kind)}", "tool_choice.type")
        choice = kinds[kind]
        parallel = not inner.boolean("disable_parallel_tool_use", False)
        if choice == "function":
            function = inner.string("name")
            if function not in names:
                raise invalid(f"'tool_choice.name' {show(function)} is not among 'tools' "
                              f"({', '.join(names) or 'none'})", "tool_choice.name")
    if not tools:
        if choice in ("required", "function"):
            raise invalid("'tool_choice' asks for a tool, but the request has no 'tools'",
                          "tool_choice")
        return None
    return ToolUse(tools, choice, function, parallel)


def _tool(item: Any, path: str, ignored: list[str] | None) -> Tool:
    fields = member(item, path)
    kind = fields.string("type")
    if kind not in (None, "custom"):
        raise invalid(f"'{path}.type' {kind!r} is one of Anthropic's server tools, which "
                      "this server does not run; send custom tools (name, description, "
                      "input_schema)", f"{path}.type", "unsupported_tool")
    check_fields(item, TOOL_FIELDS, path, ignored)
    name = fields.string("name")
    if name is None or not NAME.match(name):
        raise invalid(f"'{path}.name' must be 1 to 128 letters, digits, '_' or '-', not "
                      f"{show(name)}", f"{path}.name")
    schema = fields.object("input_schema", "a JSON schema object")
    if schema is None:
        raise invalid(f"'{path}.input_schema' is required", f"{path}.input_schema")
    fields.boolean("strict", False)  # a forced call's grammar follows the schema either way
    fields.boolean("eager_input_streaming", False)  # a call's input is sent whole, at once
    return Tool(name, fields.string("description"), json.dumps(schema, ensure_ascii=False))


def _thinking(fields: Fields, ignored: list[str] | None) -> tuple[bool, str | None, bool]:
    """Anthropic's thinking switch (the template's ``enable_thinking``: off unless asked),
    the effort (``thinking.budget_tokens``, or ``output_config.effort``, which wins), and
    whether thinking is shown."""
    on, effort, show_thinking = False, None, True
    spec = fields.object("thinking")
    if spec is not None:
        inner = Fields(spec, "thinking")
        kind = inner.string("type")
        if kind not in THINKING_FIELDS:
            raise invalid("'thinking.type' must be enabled, adaptive or disabled, not "
                          f"{show(kind)}", "thinking.type")
        check_fields(spec, THINKING_FIELDS[kind], "thinking", ignored)
        on = kind != "disabled"
        if kind == "enabled":
            budget = inner.integer("budget_tokens", 1)
            if budget is None:
                raise invalid("'thinking.budget_tokens' is required when thinking is "
                              "enabled", "thinking.budget_tokens")
            effort = next((e for bound, e in BUDGET_EFFORTS if budget < bound), "high")
        display = inner.string("display")
        if display not in (None, "summarized", "omitted"):
            raise invalid("'thinking.display' must be summarized or omitted",
                          "thinking.display")
        show_thinking = display != "omitted"
    config = fields.object("output_config")
    if config is not None:
        check_fields(config, OUTPUT_CONFIG_FIELDS, "output_config", ignored)
        asked = Fields(config, "output_config").string("effort")
        if asked is not None:
            if asked not in EFFORTS:
                raise invalid(f"'output_config.effort' must be one of {', '.join(EFFORTS)}",
                              "output_config.effort")
            effort = read_effort(asked)
    return on, effort, show_thinking


def _keep_thinking(fields: Fields, ignored: list[str] | None) -> int | None:
    """How many assistant turns keep their reasoning (None: all)."""
    spec = fields.object("context_management")
    if spec is None:
        return None
    check_fields(spec, CONTEXT_MANAGEMENT_FIELDS, "context_management", ignored)
    keep: int | None = None
    for i, edit in enumerate(Fields(spec, "context_management").array("edits") or []):
        path = f"context_management.edits[{i}]"
        block = member(edit, path)
        if block.string("type") != "clear_thinking_20251015":
            raise invalid(f"'{path}.type' {show(edit.get('type'))} is not supported: only "
                          "clear_thinking_20251015 edits are served (tool results are kept)",
                          f"{path}.type", "unsupported_parameter")
        value = edit.get("keep")
        if value in (None, "all"):
            continue
        turns = member(value, f"{path}.keep")
        if turns.string("type") != "thinking_turns":
            raise invalid(f"'{path}.keep' must be \"all\" or {{\"type\": \"thinking_turns\", "
                          "\"value\": N}", f"{path}.keep")
        n = turns.integer("value", 0)
        keep = n if keep is None or n is None else min(keep, n)
    return keep


def _clear_thinking(messages: list[ChatMessage], keep: int | None) -> list[ChatMessage]:
    """The reasoning of all but the last ``keep`` assistant turns that have one, dropped."""
    if keep is None:
        return messages
    thinking = [i for i, m in enumerate(messages) if m.reasoning is not None]
    dropped = set(thinking[: max(len(thinking) - keep, 0)])
    return [ChatMessage(m.role, m.content, m.tool_calls, m.tool_call_id, m.name, None)
            if i in dropped else m for i, m in enumerate(messages)]


def _metadata(fields: Fields, ignored: list[str] | None) -> None:
    value = fields.object("metadata")
    if value is not None:  # user_id: the caller's own label; nothing stored
        check_fields(value, METADATA_FIELDS, "metadata", ignored)


def _stops(fields: Fields) -> tuple[str, ...]:
    value = fields.array("stop_sequences", "an array of strings")
    if value is None:
        return ()
    if len(value) > MAX_STOP_SEQUENCES:
        raise invalid(f"'stop_sequences' holds {len(value)} strings; at most "
                      f"{MAX_STOP_SEQUENCES} are allowed", "stop_sequences")
    for i, text in enumerate(value):
        if not isinstance(text, str) or not 1 <= len(text) <= MAX_STOP_CHARS:
            raise invalid(f"'stop_sequences[{i}]' must be a string of 1 to {MAX_STOP_CHARS} "
                          "characters", f"stop_sequences[{i}]")
        check_text(text, f"stop_sequences[{i}]")
    return tuple(value)


def _or(value: int | None, default: int) -> int:
    """A field's value, or its default when the request left it out."""
    return default if value is None else value
