"""A chat request's tools: ``tools``, ``tool_choice``, ``parallel_tool_calls``, read and
checked, and the earlier tool calls its assistant messages carry.

- ``tools``: function tools only (``{"type": "function", "function": {"name",
  "description", "parameters"}}``), at most ``MAX_TOOLS``, names unique and as OpenAI
  allows them (``NAME``); ``parameters`` a JSON schema object (left out: no arguments).
  An empty list is no tools.
- ``tool_choice``: "auto" (the default with tools), "none" (the template is given no
  tools: the model answers in text), "required" (at least one call), or
  ``{"type": "function", "function": {"name": ...}}`` (that one, and only it is given to
  the template). "required" and a named function are forced by a grammar
  (``tools/grammar.py``; the local engine enforces it); "required" or a named function
  without tools is refused.
- ``parallel_tool_calls`` (default true): false is honoured by ending the answer after its
  first tool call.
- an assistant message's ``tool_calls``: each ``{"id", "type": "function", "function":
  {"name", "arguments"}}``, ``arguments`` a JSON object's text, as OpenAI sends it.

Tools are checked against what the model offers in ``app.py``: a model whose chat
template or tokenizer has no tool calling refuses tools (400 naming the model) unless
``tool_choice`` is "none".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from mlxceld.api.codec import CalledTool
from mlxceld.api.errors import invalid
from mlxceld.api.fields import Fields, kind, member, show

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
ChoiceKind = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters`` is its JSON schema's text."""

    name: str
    description: str | None
    parameters: str

    def template_dict(self) -> dict[str, Any]:
        """OpenAI's tool object, as chat templates (and mlx-lm's parsers) read it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """The request's tools and how they may be used. ``function``: the named choice."""

    tools: tuple[Tool, ...]
    choice: ChoiceKind = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the template is given: none for "none", the named one alone."""
        if self.choice == "none":
            return ()
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools

    @property
    def forced(self) -> bool:
        """Whether the answer must be tool calls ("required", a named function)."""
        return self.choice in ("required", "function")


def parse_tool_use(fields: Fields) -> ToolUse | None:
    """The request's tools, None when it has none (and ``tool_choice`` allows that)."""
    tools = parse_tools(fields, _tool, "function.name")
    choice, function = _choice(fields)
    return tool_use(fields, tools, choice, function, "tool_choice.function.name")


def tool_use(fields: Fields, tools: tuple[Tool, ...], choice: ChoiceKind, function: str | None,
             function_param: str) -> ToolUse | None:
    """The tools and the choice among them, checked together (OpenAI's chat and Responses
    APIs alike; ``function_param``: where the request names the chosen function), with
    ``parallel_tool_calls``; None when there are no tools and the choice allows that."""
    parallel = fields.boolean("parallel_tool_calls", True)
    if not tools:
        if choice in ("required", "function"):
            raise invalid(f"'tool_choice' is {show(fields.get('tool_choice'))}, but the "
                          "request has no 'tools'; send the tools to choose from",
                          "tool_choice")
        return None
    if function is not None and function not in {t.name for t in tools}:
        raise invalid(f"'tool_choice' names the function {function!r}, which is not among "
                      f"'tools' ({', '.join(t.name for t in tools)})", function_param)
    return ToolUse(tools, choice, function, parallel)


def parse_tools(fields: Fields, read: Callable[[Any, str], Tool], name_key: str,
                limit: int = MAX_TOOLS) -> tuple[Tool, ...]:
    """The request's ``tools``, each read by ``read`` (the API's tool shape), at most
    ``limit`` (the API's) and each name once (``name_key``: where a tool holds its name).
    OpenAI's chat and Responses APIs and Anthropic's Messages API read their tools so."""
    value = fields.array("tools", "an array of tools")
    if value is None:
        return ()
    if len(value) > limit:
        raise invalid(f"'tools' holds {len(value)} tools; at most {limit} are allowed",
                      "tools")
    tools = tuple(read(item, f"tools[{i}]") for i, item in enumerate(value))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise invalid(f"'tools[{i}].{name_key}' {tool.name!r} is declared twice; "
                          "give each tool its own name", f"tools[{i}].{name_key}")
        seen.add(tool.name)
    return tools


def _tool(item: Any, path: str) -> Tool:
    fields = member(item, path)
    tool_type = fields.string("type")
    if tool_type != "function":
        raise invalid(f"'{path}.type' must be \"function\" (only function tools are "
                      f"served), not {show(tool_type)}", f"{path}.type")
    inner = _function(fields)
    name = function_name(inner)
    description = inner.string("description")
    parameters = inner.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise inner.wrong("parameters", "a JSON schema object")
    inner.boolean("strict", False)  # checked; the grammar follows the schema either way
    return Tool(name, description, json.dumps(parameters, ensure_ascii=False))


def function_name(fields: Fields) -> str:
    """A tool's or a call's required ``name``, as OpenAI allows names (``NAME``)."""
    name = fields.string("name")
    if name is None:
        raise invalid(f"'{fields.path('name')}' is required", fields.path("name"))
    if not NAME.match(name):
        raise invalid(f"'{fields.path('name')}' must be 1 to 64 letters, digits, '_' or '-', "
                      f"not {show(name)}", fields.path("name"))
    return name


def _choice(fields: Fields) -> tuple[ChoiceKind, str | None]:
    value = fields.get("tool_choice")
    if value is None or value == "auto":
        return "auto", None
    if value == "none":
        return "none", None
    if value == "required":
        return "required", None
    if isinstance(value, dict):
        choice = Fields(value, "tool_choice")
        if choice.string("type") != "function":
            raise invalid("'tool_choice.type' must be \"function\", not "
                          f"{show(value.get('type'))}", "tool_choice.type")
        function = value.get("function")
        if not isinstance(function, dict):
            raise choice.wrong("function", "an object with the function's name")
        return "function", function_name(Fields(function, "tool_choice.function"))
    raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}, not "
                  f"{show(value)}", "tool_choice")


def parse_called_tools(fields: Fields) -> tuple[CalledTool, ...]:
    """An assistant message's ``tool_calls``."""
    value = fields.array("tool_calls", "an array of tool calls")
    if value is None:
        return ()
    return tuple(_called(item, fields.path(f"tool_calls[{i}]"))
                 for i, item in enumerate(value))


def _function(fields: Fields) -> Fields:
    """A tool's or a call's required ``function`` object."""
    function = fields.object("function")
    if function is None:
        raise fields.wrong("function", "an object")
    return Fields(function, fields.path("function"))


def _called(item: Any, path: str) -> CalledTool:
    fields = member(item, path)
    call_id = fields.string("id")
    if call_id is None:
        raise invalid(f"'{path}.id' is required", f"{path}.id")
    call_type = fields.string("type")
    if call_type not in (None, "function"):
        raise invalid(f"'{path}.type' must be \"function\", not {show(call_type)}",
                      f"{path}.type")
    inner = _function(fields)
    name = function_name(inner)
    arguments = inner.get("arguments")
    if isinstance(arguments, dict):  # some clients send the object itself
        return CalledTool(call_id, name, json.dumps(arguments, ensure_ascii=False))
    return CalledTool(call_id, name, call_arguments(inner))


def call_arguments(fields: Fields) -> str:
    """An earlier call's required ``arguments``: a JSON object's text, as the model gave
    it (OpenAI's chat and Responses APIs alike), re-serialized."""
    where = fields.path("arguments")
    text = fields.string("arguments")
    if text is None:
        raise invalid(f"'{where}' is required", where)
    try:
        parsed = json.loads(text or "{}")
    except (ValueError, RecursionError) as exc:
        raise invalid(f"'{where}' is not valid JSON ({exc}); send the arguments as the "
                      "model gave them", where) from None
    if not isinstance(parsed, dict):
        raise invalid(f"'{where}' must hold a JSON object, not {kind(parsed)}", where)
    return json.dumps(parsed, ensure_ascii=False)
