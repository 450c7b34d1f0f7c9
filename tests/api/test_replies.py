"""A chat answer split into content, reasoning and tool calls, over text in any pieces."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxceld.api.tools.calls import ToolCall, parse_calls
from mlxceld.api.tools.replies import CallText, ChatReply, Part, ReplySplitter, Said

from helpers.fakes import TOOL_FEATURES

CALL = '{"name": "f", "arguments": {"x": 1}}'
ANSWER = f"plan it</think>\n\nSure.<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>"


def split(text: str, cuts: list[int], **options: bool) -> list[Part]:
    splitter = ReplySplitter(TOOL_FEATURES, tools=options.get("tools", True),
                             thinking=options.get("thinking", True))
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    parts: list[Part] = []
    for a, b in pairwise(bounds):
        parts += splitter.feed(text[a:b])
    return parts + splitter.finish()


def joined(parts: list[Part]) -> list[Part]:
    """Adjacent text of one kind merged: how the pieces fall must not matter."""
    out: list[Part] = []
    for part in parts:
        if out and isinstance(part, Said) and isinstance(out[-1], Said) \
                and out[-1].kind == part.kind:
            out[-1] = Said(part.kind, out[-1].text + part.text)
        else:
            out.append(part)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_cut_gives_the_same_parts(cuts: list[int]) -> None:
    # The whitespace after the reasoning's end marker is not content.
    assert joined(split(ANSWER, cuts)) == [Said("reasoning", "plan it"),
                                           Said("content", "Sure."),
                                           CallText(CALL), CallText(CALL)]


def test_without_tools_calls_are_content_and_without_thinking_it_starts_as_content() -> None:
    assert joined(split(ANSWER, [3, 40], tools=False)) == [
        Said("reasoning", "plan it"),
        Said("content", f"Sure.<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>")]
    assert joined(split("<think>hm</think>ok", [1, 2, 9], thinking=False)) == [
        Said("reasoning", "hm"), Said("content", "ok")]


def test_an_unfinished_call_and_a_held_prefix_are_shown_as_content() -> None:
    assert joined(split('a<tool_call>{"name": "f"', [5], thinking=False)) == [
        Said("content", 'a<tool_call>{"name": "f"')]
    assert joined(split("a</thi", [2], thinking=False)) == [Said("content", "a</thi")]


def test_one_call_when_parallel_calls_are_off() -> None:
    splitter = ReplySplitter(TOOL_FEATURES, tools=True, thinking=False, max_calls=1)
    parts = splitter.feed(f"<tool_call>{CALL}</tool_call><tool_call>")
    assert parts == [CallText(CALL)] and splitter.done and splitter.finish() == []


def test_calls_are_read_or_shown_as_content(caplog: pytest.LogCaptureFixture) -> None:
    def read(text: str) -> list[ToolCall] | None:
        return parse_calls(text, TOOL_FEATURES.parse_tool_call,  # type: ignore[arg-type]
                           None, request_id="r")

    reply = ChatReply(ReplySplitter(TOOL_FEATURES, tools=True, thinking=False), TOOL_FEATURES,
                      read)
    readings = reply.feed(f"<tool_call>{CALL}</tool_call><tool_call>not json</tool_call>")
    called, shown = readings
    assert [(c.name, json.loads(c.arguments)) for c in called.calls] == [("f", {"x": 1})]  # type: ignore[union-attr]
    assert called.calls[0].id.startswith("call_")  # type: ignore[union-attr]
    assert shown == Said("content", "<tool_call>not json</tool_call>")
    assert "request r: a tool call the model's parser cannot read" in caplog.text
    assert reply.called
    # A name missing, arguments that are not an object: content too.
    assert read('{"arguments": {}}') is None and read('{"name": "f", "arguments": 3}') is None
    assert read('{"name": "f", "arguments": "{\\"y\\": 2}"}') is not None


def test_a_list_with_one_unreadable_call_is_content_not_fewer_calls() -> None:
    """Of two calls the parser read, one has no name: the text goes back as content, whole,
    rather than one call of two being dropped without a word."""
    def parser(text: str, tools: Any) -> Any:
        return [{"name": "get_time", "arguments": {}}, {"arguments": {"city": "Oslo"}}]

    assert parse_calls("two calls", parser, None, request_id="r") is None
    (call,) = parse_calls("one call", lambda text, tools: [{"name": "get_time"}], None,
                          request_id="r") or []
    assert (call.name, call.arguments) == ("get_time", "{}")
