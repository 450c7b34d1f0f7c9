"""The Messages API's turns (``system`` and ``messages``), their content blocks read
into the chat messages a template renders (``messages.py`` says what each block becomes).

Each turn's and block's fields are checked by name against ``anthropic/surface.py``'s
tables (``surface.check_fields``: one no table lists is refused, or ignored and named
under ``[serve] unknown_fields = "warn"``); images, documents and server tools' blocks are
refused by type.
"""

from __future__ import annotations

import json
from typing import Any

from mlxceld.api.anthropic.surface import BLOCK_FIELDS, TURN_FIELDS
from mlxceld.api.codec import CalledTool, ChatMessage
from mlxceld.api.errors import ApiError, invalid
from mlxceld.api.fields import Fields, check_text, member, show
from mlxceld.api.surface import check_fields

BILLING_LINE = "x-anthropic-billing-header:"  # Claude Code's per-request line, left out
Ignored = list[str] | None  # unknown fields' paths (``[serve] unknown_fields = "warn"``)


def system_messages(fields: Fields, ignored: Ignored = None) -> list[ChatMessage]:
    value = fields.get("system")
    if value is None:
        return []
    text = _text_content(value, "system", ignored)
    return [ChatMessage("system", text)] if text else []


def _text_content(value: Any, path: str, ignored: Ignored) -> str:
    """A string, or text blocks joined with newlines (Claude Code's billing line left
    out of a system prompt)."""
    if isinstance(value, str):
        return check_text(value, path)
    if not isinstance(value, list):
        raise invalid(f"{path!r} must be a string or an array of text blocks", path)
    texts = []
    for i, item in enumerate(value):
        text = _text_block(item, f"{path}[{i}]", ignored)
        if not (path == "system" and text.startswith(BILLING_LINE)):
            texts.append(text)
    return "\n".join(texts)


def _text_block(item: Any, path: str, ignored: Ignored) -> str:
    block = member(item, path)
    kind = block.string("type")
    if kind != "text":
        raise _not_text(kind, path)
    check_fields(item, BLOCK_FIELDS["text"], path, ignored)
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


def turn_messages(fields: Fields, ignored: Ignored = None) -> list[ChatMessage]:
    value = fields.array("messages", "an array of messages")
    if value is None:
        raise invalid("'messages' is required", "messages")
    if not value:
        raise invalid("'messages' is empty; send at least one user message", "messages")
    out: list[ChatMessage] = []
    for i, item in enumerate(value):
        path = f"messages[{i}]"
        message = member(item, path)
        check_fields(item, TURN_FIELDS, path, ignored)
        role = message.string("role")
        content = message.get("content")
        if content is None:
            raise invalid(f"'{path}.content' is required", f"{path}.content")
        if role == "user":
            out.extend(_user(content, path, ignored))
        elif role == "assistant":
            if i == len(value) - 1:
                raise invalid(f"'{path}' is an assistant message last (a prefill): this "
                              "server always opens a new answer; end with a user message",
                              f"{path}.role")
            out.append(_assistant(content, path, ignored))
        elif role == "system":
            out.append(ChatMessage("system", _text_content(content, f"{path}.content",
                                                           ignored)))
        else:
            raise invalid(f"'{path}.role' must be \"user\" or \"assistant\", not {show(role)}",
                          f"{path}.role")
    return out


def _user(content: Any, path: str, ignored: Ignored) -> list[ChatMessage]:
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
            out.append(_tool_result(item, where, ignored))
        else:
            texts.append(_text_block(item, where, ignored))
    if texts or not out:
        out.append(ChatMessage("user", "\n".join(texts)))
    return out


def _tool_result(item: dict[str, Any], path: str, ignored: Ignored) -> ChatMessage:
    check_fields(item, BLOCK_FIELDS["tool_result"], path, ignored)
    block = Fields(item, path)
    call_id = block.string("tool_use_id")
    if call_id is None:
        raise invalid(f"'{path}.tool_use_id' is required", f"{path}.tool_use_id")
    content = item.get("content")
    text = "" if content is None else _text_content(content, f"{path}.content", ignored)
    if block.boolean("is_error", False):
        text = f"Error: {text}"
    return ChatMessage("tool", text, tool_call_id=call_id)


def _assistant(content: Any, path: str, ignored: Ignored) -> ChatMessage:
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
            texts.append(_text_block(item, where, ignored))
        elif kind == "tool_use":
            calls.append(_tool_use_block(item, where, ignored))
        elif kind == "thinking":
            check_fields(item, BLOCK_FIELDS["thinking"], where, ignored)
            thoughts.append(block.string("thinking") or "")
        elif kind == "redacted_thinking":
            check_fields(item, BLOCK_FIELDS["redacted_thinking"], where, ignored)
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


def _tool_use_block(item: dict[str, Any], path: str, ignored: Ignored) -> CalledTool:
    check_fields(item, BLOCK_FIELDS["tool_use"], path, ignored)
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
