"""A Responses body's ``input`` (``responses.py``): a string, or input items read into
the chat messages a template renders.

Messages (``role`` user, assistant, system or developer, read as system; ``content`` a
string or text parts, joined with newlines); ``function_call`` items, joined to the
assistant message before them (consecutive calls are one message); a
``function_call_output`` item, a tool message for its ``call_id``; a ``reasoning`` item,
its ``content`` text (else its summary's) given to the next assistant message as its
reasoning. Each item's fields are checked against ``responses/surface.py``'s tables
(``surface.check_fields``, ``ignored`` under ``[serve] unknown_fields = "warn"``); a
call's name and arguments as chat's (``tools/choice.py``).
"""

from __future__ import annotations

from typing import Any

from mlxceld.api.codec import CalledTool, ChatMessage
from mlxceld.api.errors import invalid
from mlxceld.api.fields import Fields, check_text, member, show
from mlxceld.api.responses.surface import (
    CALL_ITEM_FIELDS,
    MESSAGE_ITEM_FIELDS,
    MESSAGE_ITEM_ROLES,
    OUTPUT_ITEM_FIELDS,
    PART_FIELDS,
    REASONING_ITEM_FIELDS,
    STATELESS,
    TEXT_PARTS,
)
from mlxceld.api.surface import check_fields
from mlxceld.api.tools.choice import call_arguments, function_name

Ignored = list[str] | None  # unknown fields' paths (``[serve] unknown_fields = "warn"``)


def input_messages(fields: Fields, ignored: Ignored = None) -> list[ChatMessage]:
    """``input``: a string (one user message) or input items, as chat messages."""
    value = fields.get("input")
    if value is None:
        raise invalid("'input' is required: a string or a list of input items", "input")
    if isinstance(value, str):
        return [ChatMessage("user", check_text(value, "input"))]
    if not isinstance(value, list):
        raise fields.wrong("input", "a string or an array of input items")
    if not value:
        raise invalid("'input' is empty; send at least one message", "input")
    reader = _Items(ignored)
    for i, item in enumerate(value):
        reader.read(item, f"input[{i}]")
    return reader.finish()


class _Items:
    """Input items into chat messages: function calls joined to the assistant message
    before them, a reasoning item's text kept for the next assistant message."""

    def __init__(self, ignored: Ignored) -> None:
        self.ignored = ignored
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
            check_fields(item, OUTPUT_ITEM_FIELDS, path, self.ignored)
            self._flush_reasoning()
            self.messages.append(ChatMessage("tool", _output(fields, self.ignored), (),
                                             required(fields, "call_id")))
            self.calls_open = False
        elif item_type == "reasoning":
            check_fields(item, REASONING_ITEM_FIELDS, path, self.ignored)
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
        check_fields(item, MESSAGE_ITEM_FIELDS, path, self.ignored)
        name = fields.string("role")
        role = MESSAGE_ITEM_ROLES.get(name or "")
        if role is None:
            raise invalid(f"'{path}.role' must be one of {', '.join(MESSAGE_ITEM_ROLES)}, "
                          f"not {show(name)}", f"{path}.role")
        text = _content(fields, path, self.ignored)
        if role == "assistant":
            self.messages.append(ChatMessage("assistant", text, reasoning=self.reasoning))
            self.reasoning = None
            self.calls_open = True
            return
        self._flush_reasoning()
        self.messages.append(ChatMessage(role, text))  # type: ignore[arg-type]
        self.calls_open = False

    def _call(self, item: Any, fields: Fields, path: str) -> None:
        check_fields(item, CALL_ITEM_FIELDS, path, self.ignored)
        call = CalledTool(required(fields, "call_id"), function_name(fields),
                          call_arguments(fields))
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


def required(fields: Fields, name: str) -> str:
    value = fields.string(name)
    if value is None:
        raise invalid(f"'{fields.path(name)}' is required", fields.path(name))
    return value


def _content(fields: Fields, path: str, ignored: Ignored) -> str:
    content = fields.get("content")
    if isinstance(content, str):
        return check_text(content, f"{path}.content")
    if isinstance(content, list):
        return "\n".join(_text_part(part, f"{path}.content[{j}]", ignored)
                         for j, part in enumerate(content))
    raise fields.wrong("content", "a string or an array of content parts")


def _text_part(part: Any, path: str, ignored: Ignored) -> str:
    fields = member(part, path)
    part_type = fields.string("type")
    if part_type not in TEXT_PARTS:
        raise invalid(f"'{path}.type' must be input_text or output_text (only text is "
                      f"served), not {show(part_type)}", f"{path}.type")
    check_fields(part, PART_FIELDS, path, ignored)
    return required(fields, "text")


def _output(fields: Fields, ignored: Ignored) -> str:
    """A function call's output: a string, or text parts."""
    value = fields.get("output")
    if isinstance(value, str):
        return check_text(value, fields.path("output"))
    if isinstance(value, list):
        return "\n".join(_text_part(p, fields.path(f"output[{j}]"), ignored)
                         for j, p in enumerate(value))
    raise fields.wrong("output", "a string or an array of input_text parts")


def _reasoning_text(fields: Fields) -> str:
    """A reasoning item's text: its ``content`` (reasoning_text parts), else its summary's."""
    for name in ("content", "summary"):
        parts = fields.array(name)
        if parts:
            texts = []
            for j, part in enumerate(parts):
                inner = member(part, fields.path(f"{name}[{j}]"))
                texts.append(required(inner, "text"))
            return "\n".join(texts)
    return ""
