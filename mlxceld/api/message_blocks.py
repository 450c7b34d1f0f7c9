"""The Messages API's turns (``system`` and ``messages``), their content blocks read
into the chat messages a template renders (``messages.py`` says what each block becomes).

Each block's fields are checked by name: one this table does not list is refused
(``BLOCK_FIELDS``); images, documents and server tools' blocks are refused by type.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mlxceld.api.codec import CalledTool, ChatMessage
from mlxceld.api.errors import ApiError, invalid
from mlxceld.api.fields import Fields, check_text, member, show

BILLING_LINE = "x-anthropic-billing-header:"  # Claude Code's per-request line, left out
BLOCK_FIELDS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "caller"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}


def _block_fields(block: Mapping[str, Any], allowed: set[str], path: str) -> None:
    extra = [n for n, v in block.items() if v is not None and n not in allowed]
    if extra:
        raise invalid(f"'{path}.{extra[0]}': Extra inputs are not permitted (a "
                      f"{show(block.get('type'))} block has {', '.join(sorted(allowed))})",
                      f"{path}.{extra[0]}", "unknown_parameter")
    citations = block.get("citations")
    if citations not in (None, []):
        raise invalid(f"'{path}.citations' is not supported: citations are not served",
                      f"{path}.citations", "unsupported_parameter")


def system_messages(fields: Fields) -> list[ChatMessage]:
    value = fields.get("system")
    if value is None:
        return []
    text = _text_content(value, "system")
    return [ChatMessage("system", text)] if text else []


def _text_content(value: Any, path: str) -> str:
    """A string, or text blocks joined with newlines (Claude Code's billing line left
    out of a system prompt)."""
    if isinstance(value, str):
        return check_text(value, path)
    if not isinstance(value, list):
        raise invalid(f"{path!r} must be a string or an array of text blocks", path)
    texts = []
    for i, item in enumerate(value):
        text = _text_block(item, f"{path}[{i}]")
        if not (path == "system" and text.startswith(BILLING_LINE)):
            texts.append(text)
    return "\n".join(texts)


def _text_block(item: Any, path: str) -> str:
    block = member(item, path)
    kind = block.string("type")
    if kind != "text":
        raise _not_text(kind, path)
    _block_fields(item, BLOCK_FIELDS["text"], path)
    text = block.string("text")
    if text is None:
        raise invalid(f"'{path}.text' is required", f"{path}.text")
    return text


def _not_text(kind: str | None, path: str) -> ApiError:
    if kind in ("image", "document", "search_result", "container_upload"):
        return invalid(f"'{path}.type' is {kind!r}: only text is served by this model "
                       "server; send the content as text", f"{path}.type",
                       "unsupported_content")
    return invalid(f"'{path}.type' must be \"text\" here, not {show(kind)}", f"{path}.type")


def turn_messages(fields: Fields) -> list[ChatMessage]:
    value = fields.array("messages", "an array of messages")
    if value is None:
        raise invalid("'messages' is required", "messages")
    if not value:
        raise invalid("'messages' is empty; send at least one user message", "messages")
    out: list[ChatMessage] = []
    for i, item in enumerate(value):
        path = f"messages[{i}]"
        message = member(item, path)
        extra = sorted(set(item) - {"role", "content"})
        if extra:
            raise invalid(f"'{path}.{extra[0]}': Extra inputs are not permitted (a message "
                          "has role and content)", f"{path}.{extra[0]}", "unknown_parameter")
        role = message.string("role")
        content = message.get("content")
        if content is None:
            raise invalid(f"'{path}.content' is required", f"{path}.content")
        if role == "user":
            out.extend(_user(content, path))
        elif role == "assistant":
            if i == len(value) - 1:
                raise invalid(f"'{path}' is an assistant message last (a prefill): this "
                              "server always opens a new answer; end with a user message",
                              f"{path}.role")
            out.append(_assistant(content, path))
        elif role == "system":
            out.append(ChatMessage("system", _text_content(content, f"{path}.content")))
        else:
            raise invalid(f"'{path}.role' must be \"user\" or \"assistant\", not {show(role)}",
                          f"{path}.role")
    return out


def _user(content: Any, path: str) -> list[ChatMessage]:
    """A user turn: its text runs as user messages, each tool result a tool message."""
    if isinstance(content, str):
        return [ChatMessage("user", check_text(content, f"{path}.content"))]
    if not isinstance(content, list):
        raise invalid(f"'{path}.content' must be a string or an array of blocks",
                      f"{path}.content")
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, item in enumerate(content):
        where = f"{path}.content[{j}]"
        kind = member(item, where).string("type")
        if kind == "tool_result":
            if texts:
                out.append(ChatMessage("user", "\n".join(texts)))
                texts = []
            out.append(_tool_result(item, where))
        else:
            texts.append(_text_block(item, where))
    if texts or not out:
        out.append(ChatMessage("user", "\n".join(texts)))
    return out


def _tool_result(item: dict[str, Any], path: str) -> ChatMessage:
    _block_fields(item, BLOCK_FIELDS["tool_result"], path)
    block = Fields(item, path)
    call_id = block.string("tool_use_id")
    if call_id is None:
        raise invalid(f"'{path}.tool_use_id' is required", f"{path}.tool_use_id")
    content = item.get("content")
    text = "" if content is None else _text_content(content, f"{path}.content")
    if block.boolean("is_error", False):
        text = f"Error: {text}"
    return ChatMessage("tool", text, tool_call_id=call_id)


def _assistant(content: Any, path: str) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage("assistant", check_text(content, f"{path}.content"))
    if not isinstance(content, list):
        raise invalid(f"'{path}.content' must be a string or an array of blocks",
                      f"{path}.content")
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[CalledTool] = []
    for j, item in enumerate(content):
        where = f"{path}.content[{j}]"
        block = member(item, where)
        kind = block.string("type")
        if kind == "text":
            texts.append(_text_block(item, where))
        elif kind == "tool_use":
            calls.append(_tool_use_block(item, where))
        elif kind == "thinking":
            _block_fields(item, BLOCK_FIELDS["thinking"], where)
            block.string("signature")
            thoughts.append(block.string("thinking") or "")
        elif kind == "redacted_thinking":
            _block_fields(item, BLOCK_FIELDS["redacted_thinking"], where)
        else:
            raise _not_assistant(kind, where)
    return ChatMessage("assistant", "\n".join(texts), tuple(calls),
                       reasoning="\n".join(thoughts) if thoughts else None)


def _not_assistant(kind: str | None, path: str) -> ApiError:
    if kind in ("image", "document", "search_result"):
        return _not_text(kind, path)
    return invalid(f"'{path}.type' {show(kind)} is not served in an assistant message: "
                   "send text, tool_use, thinking or redacted_thinking blocks "
                   "(Anthropic's server tools are not run here)", f"{path}.type")


def _tool_use_block(item: dict[str, Any], path: str) -> CalledTool:
    _block_fields(item, BLOCK_FIELDS["tool_use"], path)
    block = Fields(item, path)
    caller = block.object("caller")
    if caller is not None and caller.get("type") != "direct":
        raise invalid(f"'{path}.caller' must be {{\"type\": \"direct\"}}: tools are called "
                      "by the client here", f"{path}.caller")
    call_id = block.string("id")
    name = block.string("name")
    if not call_id or not name:
        raise invalid(f"'{path}' needs its 'id' and 'name'", path)
    arguments = block.object("input", "an object (the tool's input)")
    return CalledTool(call_id, name, json.dumps(arguments or {}, ensure_ascii=False))
