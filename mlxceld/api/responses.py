"""``POST /v1/responses`` bodies (OpenAI's Responses API), read, checked and translated into
the ``ChatRequest`` every chat-shaped endpoint shares (``chatting.py``).

Stateless: nothing is stored, so ``previous_response_id``, ``conversation``, item
references and ``store: true`` are refused by name; ``store`` left out is served the same
way (OpenAI would store the response; this server never does). Every field is in
``responses_surface.py`` (``surface.py``'s states); a field no table there knows is refused.

- ``input``: a string (one user message) or a list of items: messages (``role`` user,
  assistant, system or developer, read as system; ``content`` a string or ``input_text`` /
  ``output_text`` parts, joined with newlines), ``function_call`` items (an assistant's
  tool calls: consecutive calls, and the assistant message before them, are one message),
  ``function_call_output`` items (a tool result for its ``call_id``) and ``reasoning``
  items (their ``content`` text, else their summary's, given to the template as the next
  assistant message's reasoning, as this server returns it; ``encrypted_content`` is
  refused: this server makes none and reads none).
- ``instructions``: a system message before the input.
- ``max_output_tokens``, ``temperature``, ``top_p``: as chat's ``max_tokens``, ...
- ``tools``: function tools in the flat Responses shape (``{"type": "function", "name",
  "description", "parameters", "strict"}``); any other tool type (web search, file search,
  ...) is refused naming it. ``tool_choice`` "auto", "none", "required" or ``{"type":
  "function", "name"}``; ``parallel_tool_calls``: as chat's (``tools.py``).
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
  ``strict``, ``description``), through the same constrained decoding as chat's
  ``response_format``; ``text.verbosity`` only "medium" (the default).
- ``reasoning.effort``: given to the chat template as ``reasoning_effort`` (templates that
  read it, like gpt-oss's), and "none"/"minimal" also as ``enable_thinking: false``
  (Qwen3-style templates); a model that does not reason answers as usual.
  ``reasoning.summary`` (and its old name ``generate_summary``) is accepted: the full
  reasoning comes back as the reasoning item's ``content``, no summary is made.
- ``include``: ``message.output_text.logprobs`` (each ``output_text`` carries its tokens'
  log-probabilities, in its deltas and whole, with ``top_logprobs`` 0 to 20 alternatives
  each: the tokens of the message's text; a reasoning's or a tool call's are not shown)
  and ``reasoning.encrypted_content`` (Codex asks for it: a no-op, since reasoning is
  returned in the clear); other values are refused.
- ``truncation``: only "disabled" (a prompt too long for the context is refused).
- ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``, ``client_metadata``
  (the Codex CLI's): opaque labels, ``metadata`` echoed back.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from mlxceld.api.codec import CalledTool, ChatMessage
from mlxceld.api.errors import ApiError, invalid
from mlxceld.api.fields import Fields, check_text, kind, member, parse_object, show
from mlxceld.api.requests import OPENAI_DEFAULTS, SCHEMA_NAME_CHARS, ChatRequest, Options
from mlxceld.api.responses_surface import (
    CALL_ITEM_FIELDS,
    EFFORTS,
    FORMAT_FIELDS,
    FUNCTION_TOOL_FIELDS,
    HONOURED,
    INCLUDABLE,
    LOGPROBS,
    MESSAGE_ITEM_FIELDS,
    NO_THINKING,
    OUTPUT_ITEM_FIELDS,
    PART_FIELDS,
    REASONING_FIELDS,
    REASONING_ITEM_FIELDS,
    RESPONSES_FIELDS,
    ROLES,
    STATELESS,
    TEXT_FIELDS,
    TEXT_PARTS,
)
from mlxceld.api.surface import check_fields
from mlxceld.api.tools import MAX_TOOLS, NAME, ChoiceKind, Tool, ToolUse
from mlxceld.engine import MAX_TOP_LOGPROBS, Constraint
from mlxceld.models.generation import SamplingDefaults


@dataclass(frozen=True)
class ResponsesRequest:
    """The chat to run, and what the Response object echoes back of the request."""

    chat: ChatRequest
    echo: dict[str, Any] = field(default_factory=dict)


def parse_responses(body: bytes, *, model_id: str, aliases: Collection[str] = (),
                    defaults: SamplingDefaults = OPENAI_DEFAULTS) -> ResponsesRequest:
    """A Responses body as a ``ChatRequest``; raises ``ApiError`` naming what is wrong.
    ``aliases``: the model's other names (the answer's ``model`` is the one asked);
    ``defaults``: the sampling the request leaves out (the model's
    ``generation_config.json``; the Responses API has no ``top_k``, ``min_p`` or
    ``repetition_penalty``, so those are always the defaults)."""
    obj = parse_object(body)
    check_fields(obj, RESPONSES_FIELDS)
    fields = Fields(obj)
    model = fields.string("model")
    if model is not None and model != model_id and model not in aliases:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{model_id!r} (see GET /v1/models)", param="model",
                       code="model_not_found")
    instructions = fields.string("instructions")
    messages = ([ChatMessage("system", instructions)] if instructions else []) + \
        _input(fields)
    if fields.get("truncation") not in (None, "disabled"):
        raise invalid("'truncation' must be \"disabled\": a prompt too long for the context "
                      "is refused, never cut", "truncation", "unsupported_parameter")
    logprobs = _logprobs(fields)
    text, constraint = _text(fields)
    reasoning, template_kwargs = _reasoning(fields)
    tools, echo_tools = _tools(fields)
    choice, function = _choice(fields)
    parallel = fields.boolean("parallel_tool_calls", True)
    if not tools and choice in ("required", "function"):
        raise invalid(f"'tool_choice' is {show(fields.get('tool_choice'))}, but the request "
                      "has no 'tools'; send the tools to choose from", "tool_choice")
    if function is not None and function not in {t.name for t in tools}:
        raise invalid(f"'tool_choice' names the function {function!r}, which is not among "
                      f"'tools' ({', '.join(t.name for t in tools)})", "tool_choice.name")
    if constraint is not None and tools and choice in ("required", "function"):
        raise invalid("a forced 'tool_choice' and a 'text.format' cannot both constrain the "
                      "answer; drop one of them", "tool_choice")
    options = Options(
        model=model or model_id,
        max_tokens=fields.integer("max_output_tokens", 1),
        temperature=fields.number("temperature", defaults.temperature, 0.0, 2.0),
        top_p=fields.number("top_p", defaults.top_p, 0.0, 1.0, low_open=True),
        top_k=defaults.top_k,
        min_p=defaults.min_p,
        repetition_penalty=defaults.repetition_penalty,
        stream=fields.boolean("stream", False),
        logprobs=logprobs,
        max_tokens_param="max_output_tokens",
        constraint=constraint)
    use = ToolUse(tools, choice, function, parallel) if tools else None
    chat = ChatRequest(tuple(messages), options, use, template_kwargs)
    echo = {"instructions": instructions, "max_output_tokens": options.max_tokens,
            "temperature": options.temperature, "top_p": options.top_p,
            "tools": echo_tools, "tool_choice": _echo_choice(choice, function),
            "parallel_tool_calls": parallel, "text": text, "reasoning": reasoning,
            "metadata": fields.get("metadata") or {}, "user": fields.get("user"),
            "truncation": "disabled", "store": False,
            "top_logprobs": logprobs or 0,
            "previous_response_id": None, "background": False, "service_tier": "default"}
    return ResponsesRequest(chat, echo)


def _input(fields: Fields) -> list[ChatMessage]:
    value = fields.get("input")
    if value is None:
        raise invalid("'input' is required: a string or a list of input items", "input")
    if isinstance(value, str):
        return [ChatMessage("user", check_text(value, "input"))]
    if not isinstance(value, list):
        raise fields.wrong("input", "a string or an array of input items")
    if not value:
        raise invalid("'input' is empty; send at least one message", "input")
    reader = _Items()
    for i, item in enumerate(value):
        reader.read(item, f"input[{i}]")
    return reader.finish()


class _Items:
    """Input items into chat messages: function calls joined to the assistant message
    before them, a reasoning item's text kept for the next assistant message."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self.reasoning: str | None = None
        self.calls_open = False  # the last message is an assistant's that calls may join

    def read(self, item: Any, path: str) -> None:
        fields = member(item, path)
        item_type = fields.string("type")
        if item_type is None and "role" in item:
            item_type = "message"
        if item_type == "message":
            self._message(item, fields, path)
        elif item_type == "function_call":
            self._call(item, fields, path)
        elif item_type == "function_call_output":
            check_fields(item, OUTPUT_ITEM_FIELDS, path)
            self._flush_reasoning()
            self.messages.append(ChatMessage("tool", _output(fields), (),
                                             _required(fields, "call_id")))
            self.calls_open = False
        elif item_type == "reasoning":
            check_fields(item, REASONING_ITEM_FIELDS, path)
            self._flush_reasoning()
            self.reasoning = _reasoning_text(fields)
        elif item_type == "item_reference":
            raise invalid(f"'{path}' is an item reference; " + STATELESS + "as 'input'",
                          f"{path}.type", "unsupported_parameter")
        else:
            raise invalid(f"'{path}.type' must be message, function_call, "
                          f"function_call_output or reasoning (the items this server "
                          f"serves), not {show(item_type)}", f"{path}.type")

    def finish(self) -> list[ChatMessage]:
        self._flush_reasoning()
        return self.messages

    def _message(self, item: Any, fields: Fields, path: str) -> None:
        check_fields(item, MESSAGE_ITEM_FIELDS, path)
        name = fields.string("role")
        role = ROLES.get(name or "")
        if role is None:
            raise invalid(f"'{path}.role' must be one of {', '.join(ROLES)}, not {show(name)}",
                          f"{path}.role")
        text = _content(fields, path)
        if role == "assistant":
            self.messages.append(ChatMessage("assistant", text, reasoning=self.reasoning))
            self.reasoning = None
            self.calls_open = True
            return
        self._flush_reasoning()
        self.messages.append(ChatMessage(role, text))  # type: ignore[arg-type]
        self.calls_open = False

    def _call(self, item: Any, fields: Fields, path: str) -> None:
        check_fields(item, CALL_ITEM_FIELDS, path)
        name = _required(fields, "name")
        if not NAME.match(name):
            raise invalid(f"'{path}.name' must be 1 to 64 letters, digits, '_' or '-', not "
                          f"{show(name)}", f"{path}.name")
        call = CalledTool(_required(fields, "call_id"), name, _arguments(fields, path))
        last = self.messages[-1] if self.messages else None
        if self.calls_open and last is not None and self.reasoning is None:
            self.messages[-1] = ChatMessage("assistant", last.content,
                                            (*last.tool_calls, call),
                                            reasoning=last.reasoning)
        else:
            self.messages.append(ChatMessage("assistant", "", (call,),
                                             reasoning=self.reasoning))
            self.reasoning = None
        self.calls_open = True

    def _flush_reasoning(self) -> None:
        """A reasoning item no assistant item followed: an assistant turn of its own."""
        if self.reasoning is not None:
            self.messages.append(ChatMessage("assistant", "", reasoning=self.reasoning))
            self.reasoning = None


def _required(fields: Fields, name: str) -> str:
    value = fields.string(name)
    if value is None:
        raise invalid(f"'{fields.path(name)}' is required", fields.path(name))
    return value


def _content(fields: Fields, path: str) -> str:
    content = fields.get("content")
    if isinstance(content, str):
        return check_text(content, f"{path}.content")
    if isinstance(content, list):
        return "\n".join(_text_part(part, f"{path}.content[{j}]")
                         for j, part in enumerate(content))
    raise fields.wrong("content", "a string or an array of content parts")


def _text_part(part: Any, path: str) -> str:
    fields = member(part, path)
    part_type = fields.string("type")
    if part_type not in TEXT_PARTS:
        raise invalid(f"'{path}.type' must be input_text or output_text (only text is "
                      f"served), not {show(part_type)}", f"{path}.type")
    check_fields(part, PART_FIELDS, path)
    return _required(fields, "text")


def _output(fields: Fields) -> str:
    """A function call's output: a string, or text parts."""
    value = fields.get("output")
    if isinstance(value, str):
        return check_text(value, fields.path("output"))
    if isinstance(value, list):
        return "\n".join(_text_part(p, fields.path(f"output[{j}]"))
                         for j, p in enumerate(value))
    raise fields.wrong("output", "a string or an array of input_text parts")


def _arguments(fields: Fields, path: str) -> str:
    text = _required(fields, "arguments")
    try:
        parsed = json.loads(text or "{}")
    except (ValueError, RecursionError) as exc:
        raise invalid(f"'{path}.arguments' is not valid JSON ({exc}); send the arguments as "
                      "the model gave them", f"{path}.arguments") from None
    if not isinstance(parsed, dict):
        raise invalid(f"'{path}.arguments' must hold a JSON object, not {kind(parsed)}",
                      f"{path}.arguments")
    return json.dumps(parsed, ensure_ascii=False)


def _reasoning_text(fields: Fields) -> str:
    """A reasoning item's text: its ``content`` (reasoning_text parts), else its summary's."""
    for name in ("content", "summary"):
        parts = fields.array(name)
        if parts:
            texts = []
            for j, part in enumerate(parts):
                inner = member(part, fields.path(f"{name}[{j}]"))
                texts.append(_required(inner, "text"))
            return "\n".join(texts)
    return ""


def _logprobs(fields: Fields) -> int | None:
    """``include`` checked; None, or how many alternatives each token's logprob carries
    (``top_logprobs``) when ``include`` asks for the message's logprobs."""
    value = fields.array("include", "an array of strings")
    for j, name in enumerate(value or []):
        if name not in INCLUDABLE:
            raise invalid(f"'include[{j}]' {show(name)} is not served; only "
                          f"{' and '.join(map(show, sorted(INCLUDABLE)))} are (the second a "
                          "no-op: reasoning comes back in the clear)", f"include[{j}]",
                          "unsupported_parameter")
    top = fields.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if LOGPROBS in (value or []):
        return top or 0
    if top:
        raise invalid(f"'top_logprobs' needs 'include': [\"{LOGPROBS}\"]", "top_logprobs")
    return None


def _text(fields: Fields) -> tuple[dict[str, Any], Constraint | None]:
    """``text`` as echoed, and the constraint its format asks for."""
    value = fields.object("text")
    if value is None:
        return {"format": {"type": "text"}}, None
    check_fields(value, TEXT_FIELDS, "text")
    spec = Fields(value, "text").object("format")
    if spec is None:
        return {"format": {"type": "text"}}, None
    inner = Fields(spec, "text.format")
    kind_ = inner.string("type")
    if kind_ in ("text", "json_object"):
        check_fields(spec, {"type": HONOURED}, "text.format")
    if kind_ == "text":
        return {"format": {"type": "text"}}, None
    if kind_ == "json_object":
        return {"format": {"type": "json_object"}}, Constraint("json_object")
    if kind_ != "json_schema":
        raise invalid(f"'text.format.type' must be one of text, json_object, json_schema, "
                      f"not {show(kind_)}", "text.format.type")
    name = inner.string("name")
    if name is None or not 1 <= len(name) <= SCHEMA_NAME_CHARS or \
            not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise invalid(f"'text.format.name' must be 1 to {SCHEMA_NAME_CHARS} letters, digits, "
                      f"'_' or '-', not {show(name)}", "text.format.name")
    check_fields(spec, FORMAT_FIELDS, "text.format")
    description = inner.string("description")
    strict = inner.boolean("strict", False)
    schema = inner.object("schema", "an object (a JSON schema)")
    if schema is None:
        raise invalid("'text.format.schema' is required: the JSON schema the output must "
                      "match", "text.format.schema")
    echo = {"type": "json_schema", "name": name, "schema": schema, "strict": strict,
            "description": description}
    return {"format": echo}, Constraint("json_schema", json.dumps(schema, ensure_ascii=False))


def _reasoning(fields: Fields) -> tuple[dict[str, Any] | None, tuple[tuple[str, Any], ...]]:
    """``reasoning`` as echoed, and what the chat template is given for its effort."""
    value = fields.object("reasoning")
    if value is None:
        return None, ()
    check_fields(value, REASONING_FIELDS, "reasoning")
    inner = Fields(value, "reasoning")
    effort = inner.string("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}, not "
                      f"{show(effort)}", "reasoning.effort")
    summary = inner.string("summary") or inner.string("generate_summary")
    if summary is not None and summary not in ("auto", "concise", "detailed", "none"):
        raise invalid(f"'reasoning.summary' must be auto, concise, detailed or none, not "
                      f"{show(summary)}", "reasoning.summary")
    kwargs: tuple[tuple[str, Any], ...] = ()
    if effort is not None:
        kwargs = (("reasoning_effort", effort),)
        if effort in NO_THINKING:
            kwargs += (("enable_thinking", False),)
    return {"effort": effort, "summary": summary}, kwargs


def _tools(fields: Fields) -> tuple[tuple[Tool, ...], list[dict[str, Any]]]:
    """The function tools, and their echo (the flat Responses shape)."""
    value = fields.array("tools", "an array of tools")
    if not value:
        return (), []
    if len(value) > MAX_TOOLS:
        raise invalid(f"'tools' holds {len(value)} tools; at most {MAX_TOOLS} are allowed",
                      "tools")
    tools: list[Tool] = []
    echo: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        path = f"tools[{i}]"
        inner = member(item, path)
        tool_type = inner.string("type")
        if tool_type != "function":
            raise invalid(f"'{path}.type' {show(tool_type)} is not served: only function "
                          "tools are; leave the others out", f"{path}.type",
                          "unsupported_parameter")
        check_fields(item, FUNCTION_TOOL_FIELDS, path)
        name = _required(inner, "name")
        if not NAME.match(name):
            raise invalid(f"'{path}.name' must be 1 to 64 letters, digits, '_' or '-', not "
                          f"{show(name)}", f"{path}.name")
        if name in {t.name for t in tools}:
            raise invalid(f"'{path}.name' {name!r} is declared twice; give each tool its own "
                          "name", f"{path}.name")
        parameters = inner.object("parameters", "a JSON schema object") or \
            {"type": "object", "properties": {}}
        description = inner.string("description")
        strict = inner.boolean("strict", True)  # checked; the grammar follows the schema
        tools.append(Tool(name, description, json.dumps(parameters, ensure_ascii=False)))
        echo.append({"type": "function", "name": name, "description": description,
                     "parameters": parameters, "strict": strict})
    return tuple(tools), echo


def _choice(fields: Fields) -> tuple[ChoiceKind, str | None]:
    value = fields.get("tool_choice")
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        check_fields(value, {"type": HONOURED, "name": HONOURED}, "tool_choice")
        name = _required(Fields(value, "tool_choice"), "name")
        return "function", name
    raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                  "{\"type\": \"function\", \"name\": ...} (only function tools are served), "
                  f"not {show(value)}", "tool_choice")


def _echo_choice(choice: ChoiceKind, function: str | None) -> Any:
    return {"type": "function", "name": function} if choice == "function" else choice
