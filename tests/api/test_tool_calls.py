"""Tools, tool calls and reasoning through the router app, as the real ``openai`` client
sees them (in process, over a fake engine and a byte codec with a tool template)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from mlxceld.api.fields import Fields
from mlxceld.api.tools.choice import ToolUse, parse_tool_use

from helpers.api import MODEL, make_app, openai_client
from helpers.fakes import FakeEngine, ToolByteCodec

USER = [{"role": "user", "content": "weather in Paris?"}]
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK: Any = {"type": "function", "function": {"name": "get_time"}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
REPLY = f"look it up</think>Let me check.<tool_call>{CALL}</tool_call>"
TWO_CALLS = REPLY + f"<tool_call>{CALL}</tool_call>"


def test_a_tool_call_whole_with_reasoning_apart() -> None:
    async def main() -> None:
        engine, codec = FakeEngine(context_length=4096, reply=REPLY.encode()), ToolByteCodec()
        async with openai_client(make_app(engine, codec)) as client:
            answer = await client.chat.completions.create(model=MODEL, messages=USER,
                                                          tools=[WEATHER, CLOCK])
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        assert choice.message.model_extra == {"reasoning_content": "look it up"}
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
        [(_, tools, kwargs)] = codec.templated
        assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
        assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
        assert kwargs == {}

    asyncio.run(main())


def test_a_tool_call_streamed_as_openai_streams_them() -> None:
    async def main() -> None:
        engine = FakeEngine(context_length=4096, reply=TWO_CALLS.encode())
        async with openai_client(make_app(engine, ToolByteCodec())) as client:
            stream = await client.chat.completions.create(model=MODEL, messages=USER,
                                                          tools=[WEATHER], stream=True)
            chunks = [c async for c in stream]
        deltas = [c.choices[0].delta for c in chunks]
        reasoning = "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas)
        assert reasoning == "look it up"
        assert "".join(d.content or "" for d in deltas) == "Let me check."
        calls = [tc for d in deltas for tc in d.tool_calls or []]
        assert [c.index for c in calls] == [0, 0, 1, 1]
        first, arguments = calls[:2]
        assert first.id and first.id.startswith("call_") and first.type == "function"
        assert first.function and first.function.name == "get_weather"
        assert first.function.arguments == ""
        assert arguments.id is None and arguments.function and arguments.function.name is None
        assert json.loads(arguments.function.arguments or "") == {"city": "Paris"}
        assert calls[2].id != first.id
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

    asyncio.run(main())


def test_parallel_tool_calls_false_ends_the_answer_after_one_call() -> None:
    async def main() -> None:
        engine = FakeEngine(context_length=4096, reply=(TWO_CALLS + "more").encode())
        async with openai_client(make_app(engine, ToolByteCodec())) as client:
            answer = await client.chat.completions.create(
                model=MODEL, messages=USER, tools=[WEATHER], parallel_tool_calls=False)
        assert len(answer.choices[0].message.tool_calls or []) == 1
        assert answer.choices[0].finish_reason == "tool_calls"
        assert engine.cancelled == [answer.id]  # the sequence ended at the first call

    asyncio.run(main())


def test_a_round_trip_and_template_kwargs_reach_the_template() -> None:
    async def main() -> None:
        engine, codec = FakeEngine(context_length=4096, reply=b"It is sunny."), ToolByteCodec()
        messages: Any = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        async with openai_client(make_app(engine, codec)) as client:
            answer = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER],
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        # The template opened no reasoning: all of the answer is content.
        assert answer.choices[0].message.content == "It is sunny."
        assert answer.choices[0].finish_reason == "stop"
        assert not (answer.choices[0].message.model_extra or {}).get("reasoning_content")
        [(sent, _, kwargs)] = codec.templated
        assert kwargs == {"enable_thinking": False}
        assert sent[1].template_dict()["tool_calls"] == [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
        assert sent[2].template_dict() == {"role": "tool", "content": "sunny",
                                           "tool_call_id": "call_1"}
        assert b'"arguments": {"city": "Paris"}' in bytes(engine.requests[0].prompt_tokens)

    asyncio.run(main())


def test_an_unparsable_call_is_content_and_tool_choice_none_gives_no_tools() -> None:
    async def main() -> None:
        engine = FakeEngine(context_length=4096, reply=b"</think><tool_call>{oops</tool_call>")
        codec = ToolByteCodec()
        async with openai_client(make_app(engine, codec)) as client:
            answer = await client.chat.completions.create(model=MODEL, messages=USER,
                                                          tools=[WEATHER])
            plain = await client.chat.completions.create(model=MODEL, messages=USER,
                                                         tools=[WEATHER], tool_choice="none")
        assert answer.choices[0].message.content == "<tool_call>{oops</tool_call>"
        assert answer.choices[0].finish_reason == "stop"
        assert not answer.choices[0].message.tool_calls
        # Without tools offered the markers are just text.
        assert plain.choices[0].message.content == "<tool_call>{oops</tool_call>"
        assert [tools for _, tools, _ in codec.templated] == [[WEATHER], None]

    asyncio.run(main())


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [WEATHER]}, "tools", f"the model '{MODEL}' does not support tool calling"),
    ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "declared twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name", "not among 'tools'"),
    ({"tool_choice": "sometimes"}, "tool_choice", '"auto", "none", "required"'),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
    ({"chat_template_kwargs": {"tools": [], "tokenize": False}},
     "chat_template_kwargs.tokenize", "'tokenize', 'tools', which the server sets itself"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    async def main() -> None:
        async with openai_client(make_app()) as client:  # ByteCodec: no tool calling
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, messages=USER,
                                                     extra_body=body)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param, error
        assert words in error["message"], error["message"]

    asyncio.run(main())


def test_tool_choice_none_on_a_model_without_tools_is_served() -> None:
    async def main() -> None:
        async with openai_client(make_app(FakeEngine(context_length=4096, reply=b"ok"))) as client:
            answer = await client.chat.completions.create(model=MODEL, messages=USER,
                                                          tools=[WEATHER], tool_choice="none")
        assert answer.choices[0].message.content == "ok"

    asyncio.run(main())


def test_the_offered_tools_follow_tool_choice() -> None:
    def use(**body: Any) -> ToolUse:
        parsed = parse_tool_use(Fields({"tools": [WEATHER, CLOCK], **body}))
        assert parsed is not None
        return parsed

    assert [t.name for t in use().offered] == ["get_weather", "get_time"]
    assert use(tool_choice="none").offered == ()
    named = use(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [t.name for t in named.offered] == ["get_time"] and named.forced
    assert use(tool_choice="required").forced and not use().forced
    assert not use(parallel_tool_calls=False).parallel
    assert parse_tool_use(Fields({"tools": []})) is None


def test_forcing_sets_a_grammar_of_the_offered_tools() -> None:
    async def main() -> None:
        forced = f"</think>\n\n<tool_call>{CALL}</tool_call>"  # what the grammar allows
        engine = FakeEngine(context_length=4096, reply=forced.encode())
        async with openai_client(make_app(engine, ToolByteCodec())) as client:
            named = await client.chat.completions.create(
                model=MODEL, messages=USER, tools=[WEATHER, CLOCK],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            await client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER],
                                                 tool_choice="required",
                                                 parallel_tool_calls=False)
            await client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model=MODEL, messages=USER, tool_choice="required", tools=[
                        {"type": "function", "function": {"name": "f", "parameters": {
                            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}])
        assert named.choices[0].finish_reason == "tool_calls"
        assert named.choices[0].message.content is None  # only whitespace besides the call
        first, second, free = (r.params.constraint for r in engine.requests)
        assert first is not None and first.kind == "lark"
        # The prompt opened <think>: the grammar closes it first; one or more calls.
        assert first.text.startswith('start: "</think>" "\\n\\n" block+\n')
        assert '"const": "get_weather"' in first.text and "get_time" not in first.text
        assert second is not None and "block+" not in second.text
        assert free is None
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == "tools"
        assert "cannot force a tool call" in error["message"]

    asyncio.run(main())
