"""Anthropic's Messages API end to end: real daemons serving the tiny fixture with the tools
chat template (``--chat-template tools``: json_tools calls, Qwen3's ``<think>``), alone
(the local engine, behind an API key sent as ``x-api-key``) and as a 2-stage pipeline,
asked with the real ``anthropic`` package, whole and streamed.

Random weights call no tool by themselves: a named tool is forced by the grammar, and its
argument is bounded (an enum, an integer range) so the call ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from helpers import served
from helpers.claude_code import claude_code_request, sse
from helpers.daemons import Daemons
from helpers.pipeline import start_pipeline
from helpers.served import serving_daemon

KEY = "sk-test-anthropic"
MODEL = "qwen3"
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {"name": "get_weather", "description": "The weather in a city for some days",
                "input_schema": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                    "required": ["city", "days"]}}
GREEDY: Any = {"temperature": 0}  # older SDKs' argument; this one sends it as extra body
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return served.tools_model(tmp_path_factory, MODEL)


@pytest.fixture(scope="module")
def local(tools_model: Path) -> Iterator[str]:
    with serving_daemon(tools_model, api_key=KEY) as base:
        yield base


def client(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def texts(message: Any, kind: str = "text") -> str:
    return "".join(getattr(b, kind) for b in message.content if b.type == kind)


def prompt(message: Any) -> int:
    """The prompt's tokens: Anthropic's usage splits off those the prompt cache gave."""
    usage = message.usage
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))


def check_messages(url: str) -> None:
    with client(url) as c:
        # Thinking on: the template opens <think>, and the answer is reasoning first.
        thought = c.messages.create(model=MODEL, max_tokens=12, messages=USER,
                                    thinking=THINKING, extra_body=GREEDY)
        with c.messages.stream(model=MODEL, max_tokens=12, messages=USER, thinking=THINKING,
                               extra_body=GREEDY) as stream:
            deltas = [e.thinking for e in stream if e.type == "thinking"]
            streamed_thought = stream.get_final_message()
        # Thinking off (Anthropic's default): text, whole and streamed alike.
        whole = c.messages.create(model=MODEL, max_tokens=16, messages=USER,
                                  system="Answer briefly.", extra_body=GREEDY)
        with c.messages.stream(model=MODEL, max_tokens=16, messages=USER,
                               system="Answer briefly.", extra_body=GREEDY) as stream:
            pieces = list(stream.text_stream)
            streamed = stream.get_final_message()
        counted = c.messages.count_tokens(model=MODEL, messages=USER, system="Answer briefly.")
        # A named tool forced by the grammar, then its result fed back.
        called = c.messages.create(model=MODEL, max_tokens=200, messages=USER,
                                   tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
        [call] = [b for b in called.content if b.type == "tool_use"]
        after = c.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER], messages=[
            *USER, called.to_param(),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "sunny"}]}], extra_body=GREEDY)
    assert thought.content[0].type == "thinking" and texts(thought, "thinking")
    assert thought.stop_reason == "max_tokens" and thought.usage.output_tokens == 12
    assert "".join(deltas) == texts(streamed_thought, "thinking") == texts(thought, "thinking")
    assert whole.content and [b.type for b in whole.content] == ["text"]
    assert "".join(pieces) == texts(streamed) == texts(whole)
    assert whole.stop_reason in ("max_tokens", "end_turn")
    assert prompt(whole) == counted.input_tokens
    assert prompt(thought) < prompt(whole)  # no system prompt
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input["city"] in ("Paris", "Oslo") and 1 <= call.input["days"] <= 7  # type: ignore[operator]
    assert called.stop_reason == "tool_use"
    assert after.stop_reason in ("end_turn", "max_tokens")
    assert prompt(after) > prompt(whole)


def check_stop_sequence(url: str) -> None:
    with client(url) as c:
        text = texts(c.messages.create(model=MODEL, max_tokens=16, messages=USER,
                                       extra_body=GREEDY))
        at = next((i for i in range(1, len(text) - 1) if text[:i].strip()), None)
        assert at is not None, f"too short an answer to stop in: {text!r}"
        stop = text[at:at + 2]
        cut = c.messages.create(model=MODEL, max_tokens=16, messages=USER,
                                stop_sequences=[stop], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert texts(cut) == text[: text.index(stop)]


def test_messages_with_an_api_key(local: str) -> None:
    check_messages(local)
    check_stop_sequence(local)
    with client(local, "sk-wrong") as c, pytest.raises(anthropic.AuthenticationError) as bad:
        c.messages.create(model=MODEL, max_tokens=4, messages=USER)
    assert bad.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": "invalid API key"}}
    with client(local) as c, pytest.raises(anthropic.BadRequestError) as unknown:
        c.messages.create(model=MODEL, max_tokens=4, messages=USER,
                          extra_body={"frobnicate": True})
    assert "frobnicate" in str(unknown.value.body)


def test_a_claude_code_request(local: str) -> None:
    """Its body and headers as Claude Code sends them (``helpers/claude_code.py``): a
    stream of Anthropic's events, the reasoning first (its thinking is enabled)."""
    body, headers = claude_code_request(MODEL, KEY)
    response = httpx.post(f"{local}/v1/messages?beta=true", json=body, headers=headers,
                          timeout=60)
    assert response.status_code == 200, response.text
    events = sse(response.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert events[2][1]["content_block"]["type"] == "thinking"
    # max_tokens 32000 is more than the context leaves: it leaves what it has.
    assert events[-2][1]["delta"]["stop_reason"] in ("model_context_window_exceeded",
                                                     "end_turn", "tool_use")


def test_messages_over_a_pipeline(tools_model: Path) -> None:
    daemons = Daemons()
    try:
        url = start_pipeline(daemons, tools_model, [(0, 2), (2, 4)]).url.removesuffix("/v1")
        check_messages(url)
    finally:
        daemons.cleanup()
