"""``POST /v1/responses`` bodies (OpenAI's Responses API), read, checked and translated into
the ``ChatRequest`` every chat-shaped endpoint shares (``chatting.py``).

Stateless: nothing is stored, so ``previous_response_id``, ``conversation``, item
references and ``store: true`` are refused by name; ``store`` left out is served the same
way (OpenAI would store the response; this server never does). Every field is in
``responses/surface.py`` (``surface.py``'s states); a field no table there knows is refused
(or, with ``[serve] unknown_fields = "warn"``, ignored and named: ``ignoring.py``).

- ``input`` (read by ``responses/items.py``): a string (one user message) or a list of
  items: messages (``role`` user,
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
  "function", "name"}``; ``parallel_tool_calls``: as chat's (``tools/choice.py``).
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
  ``strict``, ``description``), through the same constrained decoding as chat's
  ``response_format``; ``text.verbosity`` only "medium" (the default).
- ``reasoning.effort``: given to the chat template as chat's ``reasoning_effort`` is
  (``reasoning.py``: as ``reasoning_effort``, for templates that read it, like gpt-oss's;
  "none"/"minimal" also as ``enable_thinking: false``, for Qwen3-style templates; "xhigh"
  and "max" as "high"); a model that does not reason answers as usual.
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

from mlxceld.api.codec import ChatMessage
from mlxceld.api.errors import ApiError, invalid
from mlxceld.api.fields import Fields, member, parse_object, show
from mlxceld.api.reasoning import read_effort
from mlxceld.api.requests import OPENAI_DEFAULTS, SCHEMA_NAME_CHARS, ChatRequest, Options
from mlxceld.api.responses.items import Ignored, input_messages, required
from mlxceld.api.responses.surface import (
    EFFORTS,
    FORMAT_FIELDS,
    FUNCTION_TOOL_FIELDS,
    HONOURED,
    INCLUDABLE,
    LOGPROBS,
    REASONING_FIELDS,
    RESPONSES_FIELDS,
    TEXT_FIELDS,
)
from mlxceld.api.surface import check_fields
from mlxceld.api.tools.choice import ChoiceKind, Tool, function_name, parse_tools, tool_use
from mlxceld.engine import MAX_TOP_LOGPROBS, Constraint
from mlxceld.models.generation import SamplingDefaults


@dataclass(frozen=True)
class ResponsesRequest:
    """The chat to run, and what the Response object echoes back of the request."""

    chat: ChatRequest
    echo: dict[str, Any] = field(default_factory=dict)


def parse_responses(body: bytes, *, model_id: str, aliases: Collection[str] = (),
                    defaults: SamplingDefaults = OPENAI_DEFAULTS,
                    ignored: Ignored = None) -> ResponsesRequest:
    """A Responses body as a ``ChatRequest``; raises ``ApiError`` naming what is wrong.
    ``aliases``: the model's other names (the answer's ``model`` is the one asked);
    ``defaults``: the sampling the request leaves out (the model's
    ``generation_config.json``; the Responses API has no ``top_k``, ``min_p`` or
    ``repetition_penalty``, so those are always the defaults); ``ignored``: unknown fields
    are ignored, their paths put there, rather than refused (``[serve] unknown_fields =
    "warn"``)."""
    obj = parse_object(body)
    check_fields(obj, RESPONSES_FIELDS, ignored=ignored)
    fields = Fields(obj)
    model = fields.string("model")
    if model is not None and model != model_id and model not in aliases:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{model_id!r} (see GET /v1/models)", param="model",
                       code="model_not_found")
    instructions = fields.string("instructions")
    messages = ([ChatMessage("system", instructions)] if instructions else []) + \
        input_messages(fields, ignored)
    if fields.get("truncation") not in (None, "disabled"):
        raise invalid("'truncation' must be \"disabled\": a prompt too long for the context "
                      "is refused, never cut", "truncation", "unsupported_parameter")
    logprobs = _logprobs(fields)
    text, constraint = _text(fields, ignored)
    reasoning, effort = _reasoning(fields, ignored)
    tools, echo_tools = _tools(fields, ignored)
    choice, function = _choice(fields, ignored)
    use = tool_use(fields, tools, choice, function, "tool_choice.name")
    if constraint is not None and use is not None and use.forced:
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
        constraint=constraint, schema_param="text.format.schema")
    parallel = use.parallel if use is not None else fields.boolean("parallel_tool_calls", True)
    chat = ChatRequest(tuple(messages), options, use, reasoning_effort=effort)
    echo = {"instructions": instructions, "max_output_tokens": options.max_tokens,
            "temperature": options.temperature, "top_p": options.top_p,
            "tools": echo_tools, "tool_choice": _echo_choice(choice, function),
            "parallel_tool_calls": parallel, "text": text, "reasoning": reasoning,
            "metadata": fields.get("metadata") or {}, "user": fields.get("user"),
            "truncation": "disabled", "store": False,
            "top_logprobs": logprobs or 0,
            "previous_response_id": None, "background": False, "service_tier": "default"}
    return ResponsesRequest(chat, echo)


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


def _text(fields: Fields, ignored: Ignored) -> tuple[dict[str, Any], Constraint | None]:
    """``text`` as echoed, and the constraint its format asks for."""
    value = fields.object("text")
    if value is None:
        return {"format": {"type": "text"}}, None
    check_fields(value, TEXT_FIELDS, "text", ignored)
    spec = Fields(value, "text").object("format")
    if spec is None:
        return {"format": {"type": "text"}}, None
    inner = Fields(spec, "text.format")
    kind_ = inner.string("type")
    if kind_ in ("text", "json_object"):
        check_fields(spec, {"type": HONOURED}, "text.format", ignored)
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
    check_fields(spec, FORMAT_FIELDS, "text.format", ignored)
    description = inner.string("description")
    strict = inner.boolean("strict", False)
    schema = inner.object("schema", "an object (a JSON schema)")
    if schema is None:
        raise invalid("'text.format.schema' is required: the JSON schema the output must "
                      "match", "text.format.schema")
    echo = {"type": "json_schema", "name": name, "schema": schema, "strict": strict,
            "description": description}
    return {"format": echo}, Constraint("json_schema", json.dumps(schema, ensure_ascii=False))


def _reasoning(fields: Fields, ignored: Ignored) -> tuple[dict[str, Any] | None, str | None]:
    """``reasoning`` as echoed, and the effort the chat template is given
    (``reasoning.template_kwargs``, as every chat's)."""
    value = fields.object("reasoning")
    if value is None:
        return None, None
    check_fields(value, REASONING_FIELDS, "reasoning", ignored)
    inner = Fields(value, "reasoning")
    effort = inner.string("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}, not "
                      f"{show(effort)}", "reasoning.effort")
    summary = inner.string("summary") or inner.string("generate_summary")
    if summary is not None and summary not in ("auto", "concise", "detailed", "none"):
        raise invalid(f"'reasoning.summary' must be auto, concise, detailed or none, not "
                      f"{show(summary)}", "reasoning.summary")
    return {"effort": effort, "summary": summary}, \
        None if effort is None else read_effort(effort)


def _tools(fields: Fields, ignored: Ignored) -> tuple[tuple[Tool, ...], list[dict[str, Any]]]:
    """The function tools, and their echo (the flat Responses shape)."""
    echo: list[dict[str, Any]] = []

    def read(item: Any, path: str) -> Tool:
        inner = member(item, path)
        tool_type = inner.string("type")
        if tool_type != "function":
            raise invalid(f"'{path}.type' {show(tool_type)} is not served: only function "
                          "tools are; leave the others out", f"{path}.type",
                          "unsupported_parameter")
        check_fields(item, FUNCTION_TOOL_FIELDS, path, ignored)
        name = function_name(inner)
        parameters = inner.object("parameters", "a JSON schema object") or \
            {"type": "object", "properties": {}}
        description = inner.string("description")
        strict = inner.boolean("strict", True)  # checked; the grammar follows the schema
        echo.append({"type": "function", "name": name, "description": description,
                     "parameters": parameters, "strict": strict})
        return Tool(name, description, json.dumps(parameters, ensure_ascii=False))

    return parse_tools(fields, read, "name"), echo


def _choice(fields: Fields, ignored: Ignored) -> tuple[ChoiceKind, str | None]:
    value = fields.get("tool_choice")
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        check_fields(value, {"type": HONOURED, "name": HONOURED}, "tool_choice", ignored)
        return "function", required(Fields(value, "tool_choice"), "name")
    raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                  "{\"type\": \"function\", \"name\": ...} (only function tools are served), "
                  f"not {show(value)}", "tool_choice")


def _echo_choice(choice: ChoiceKind, function: str | None) -> Any:
    return {"type": "function", "name": function} if choice == "function" else choice
