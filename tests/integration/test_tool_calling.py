"""Tools and reasoning end to end: real daemons serving the tiny fixture with the tools
chat template (``--chat-template tools``: json_tools calls, ``<think>``), alone (the local
engine) and as a 2-stage pipeline, asked with the real ``openai`` client.

Random weights call no tool by themselves: "required" and a named function are forced by
the grammar, and every argument is bounded (an enum, an integer range) so the call ends.
What the router reads above the engine seam (reasoning, a round trip, the refusal) is the
same for both engines, so the pipeline's part is small; forcing needs the engine's
constraint, and is asked of the local engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from helpers import served
from helpers.daemons import Daemons
from helpers.pipeline import start_pipeline
from helpers.router import client
from helpers.served import serving_daemon

USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for some days",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
CLOCK: Any = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {},
                                       "additionalProperties": False}}}
ROUND_TRIP: Any = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
NO_THINKING: Any = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return served.tools_model(tmp_path_factory)


@pytest.fixture(scope="module")
def local(tools_model: Path) -> Iterator[str]:
    with serving_daemon(tools_model) as base:
        yield base + "/v1"


def arguments(call: Any) -> dict[str, Any]:
    value = json.loads(call.function.arguments)
    assert isinstance(value, dict)
    return value


def check_forced_calls(url: str) -> None:
    """tool_choice "required" (whole) and a named function (streamed): the grammar forces
    a call the parser reads, with arguments inside the tool's schema."""
    with client(url) as c:
        for seed in (1, 2):
            answer = c.chat.completions.create(
                model="qwen3", messages=USER, tools=[WEATHER, CLOCK], tool_choice="required",
                parallel_tool_calls=False, seed=seed, max_tokens=200)
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            [call] = choice.message.tool_calls or []
            assert call.id.startswith("call_") and call.type == "function"
            assert call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
            if call.function.name == "get_weather":  # type: ignore[union-attr]
                args = arguments(call)
                assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
            else:
                assert arguments(call) == {}
            # The grammar closed the reasoning block the template opened, at once.
            assert not (choice.message.model_extra or {}).get("reasoning_content")
        stream = c.chat.completions.create(
            model="qwen3", messages=USER, tools=[WEATHER, CLOCK], stream=True, seed=3,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False, max_tokens=200)
        chunks = list(stream)
    calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert [tc.index for tc in calls] == [0, 0]
    assert calls[0].function and calls[0].function.name == "get_weather"
    assert calls[1].function and calls[1].function.arguments
    args = json.loads(calls[1].function.arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_calls_whole_and_streamed(local: str) -> None:
    check_forced_calls(local)


def check_reasoning_and_round_trip(url: str) -> None:
    with client(url) as c:
        thinking = c.chat.completions.create(model="qwen3", messages=USER, temperature=0,
                                             max_tokens=12)
        plain = c.chat.completions.create(model="qwen3", messages=USER, temperature=0,
                                          max_tokens=12, extra_body=NO_THINKING)
        stream = c.chat.completions.create(model="qwen3", messages=USER, temperature=0,
                                           max_tokens=12, stream=True)
        deltas = [ch.choices[0].delta for ch in stream]
        # A round trip with tools offered ("auto"): the template takes the call and result.
        after = c.chat.completions.create(model="qwen3", messages=ROUND_TRIP, tools=[WEATHER],
                                          temperature=0, max_tokens=4)
        # A response_format after a prompt that opens thinking: the grammar closes the
        # reasoning first, and the JSON is the content.
        digit = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                        "maximum": 9}},
                 "required": ["a"], "additionalProperties": False}
        shaped = c.chat.completions.create(
            model="qwen3", messages=USER, temperature=0, max_tokens=20,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "digit", "schema": digit}})
    # The template opens <think>: the whole answer is reasoning, apart from content.
    reasoning = (thinking.choices[0].message.model_extra or {}).get("reasoning_content")
    assert reasoning and not thinking.choices[0].message.content
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning and not "".join(d.content or "" for d in deltas)
    # enable_thinking false reached the template: its think block is closed, so the prompt
    # is longer and the answer is content.
    assert plain.choices[0].message.content
    assert not (plain.choices[0].message.model_extra or {}).get("reasoning_content")
    assert plain.usage and thinking.usage
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens
    assert json.loads(shaped.choices[0].message.content or "")["a"] in range(10)
    assert not (shaped.choices[0].message.model_extra or {}).get("reasoning_content")
    assert after.choices[0].finish_reason in ("stop", "length")
    assert after.usage and after.usage.prompt_tokens > thinking.usage.prompt_tokens + 20


def test_reasoning_kwargs_and_a_round_trip_local(local: str) -> None:
    check_reasoning_and_round_trip(local)


@pytest.mark.slow
def test_reasoning_forced_calls_a_round_trip_and_a_refusal_in_a_pipeline(
        tools_model: Path, split_fixture_dir: Path) -> None:
    daemons = Daemons()
    try:
        url = start_pipeline(daemons, tools_model, [(0, 2), (2, 4)]).url
        check_reasoning_and_round_trip(url)
        check_forced_calls(url)  # the last stage masks under the tools' grammar
    finally:
        daemons.cleanup()
    # A model whose template has no tool calling refuses tools, naming the model.
    with serving_daemon(split_fixture_dir / "qwen3") as base, client(base + "/v1") as c, \
            pytest.raises(openai.BadRequestError) as caught:
        c.chat.completions.create(model="qwen3", messages=USER, tools=[WEATHER])
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "tools"
    assert error["code"] == "tools_not_supported"
    assert "the model 'qwen3' does not support tool calling" in error["message"]
