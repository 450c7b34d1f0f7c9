"""``/v1/messages`` as the real ``anthropic`` package sees it, on real uvicorn over a
scripted engine: text, streams, stops, tools, thinking, auth and Anthropic's errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest
from starlette.types import ASGIApp

from helpers.api import KEY, MODEL, make_app, serving
from helpers.claude_code import claude_code_request, sse
from helpers.fakes import FakeEngine, ToolByteCodec

USER: Any = [{"role": "user", "content": "hi"}]
WEATHER: Any = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
CALL = b'<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@contextlib.asynccontextmanager
async def anthropic_client(app: ASGIApp, key: str = KEY
                           ) -> AsyncIterator[tuple[anthropic.AsyncAnthropic, str]]:
    async with serving(app) as url, anthropic.AsyncAnthropic(
            base_url=url, api_key=key, max_retries=0, timeout=30) as client:
        yield client, url


def run(main: Any) -> None:
    asyncio.run(main())


def test_whole_text_with_a_system_prompt_and_turns() -> None:
    async def main() -> None:
        engine = FakeEngine(reply="Grüße!".encode())
        async with anthropic_client(make_app(engine, api_key=KEY)) as (client, _):
            message = await client.messages.create(
                model=MODEL, max_tokens=50, system="be brief",
                extra_body={"temperature": 0.5, "top_k": 3},  # older SDKs' own arguments
                messages=[*USER, {"role": "assistant", "content": "yes?"},
                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}],
                metadata={"user_id": "u-1"})
        prompt = "<system>be brief<user>hi<assistant>yes?<user>a\nb<assistant>"
        assert bytes(engine.requests[0].prompt_tokens).decode() == prompt
        assert message.id.startswith("msg_") and message.model == MODEL
        assert message.role == "assistant" and message.type == "message"
        assert [(b.type, getattr(b, "text", None)) for b in message.content] == \
            [("text", "Grüße!")]
        assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
        assert (message.usage.input_tokens, message.usage.output_tokens) == \
            (len(prompt), len("Grüße!".encode()) + 1)
        assert message.usage.cache_read_input_tokens == 0
        assert message.usage.cache_creation_input_tokens == 0
        params = engine.requests[0].params
        assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 3, 50)

    run(main)


def test_streamed_text_equals_the_whole_and_the_events_are_anthropics() -> None:
    async def main() -> None:
        engine = FakeEngine(reply="naïve café ☕".encode())
        async with anthropic_client(make_app(engine)) as (client, url):
            async with client.messages.stream(model=MODEL, max_tokens=50,
                                              messages=USER) as stream:
                pieces = [text async for text in stream.text_stream]
                final = await stream.get_final_message()
            raw = await client.messages.create(model=MODEL, max_tokens=50, messages=USER,
                                               stream=True)
            kinds = [event.type async for event in raw]
            async with httpx.AsyncClient() as http:
                text = (await http.post(f"{url}/v1/messages", json={
                    "model": MODEL, "max_tokens": 5, "messages": USER, "stream": True})).text
        assert len(pieces) > 1 and "".join(pieces) == "naïve café ☕"
        assert [b.type for b in final.content] == ["text"]
        assert final.content[0].text == "naïve café ☕"  # type: ignore[union-attr]
        assert final.stop_reason == "end_turn"
        assert final.usage.output_tokens == len("naïve café ☕".encode()) + 1
        assert kinds[:2] == ["message_start", "content_block_start"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        events = sse(text)
        assert [n for n, _ in events][:2] == ["message_start", "ping"]
        assert all(data["type"] == name for name, data in events)
        delta = events[-2][1]
        assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert delta["usage"]["output_tokens"] == 5

    run(main)


def test_stop_sequences_max_tokens_and_the_context_window() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"one two three four five")
        async with anthropic_client(make_app(engine)) as (client, _):
            stopped = await client.messages.create(
                model=MODEL, max_tokens=50, messages=USER, stop_sequences=["four", "hree"])
            async with client.messages.stream(model=MODEL, max_tokens=50, messages=USER,
                                              stop_sequences=["two"]) as stream:
                streamed = await stream.get_final_message()
            cut = await client.messages.create(model=MODEL, max_tokens=4, messages=USER)
            # More than the context leaves (256 less the prompt): as much as it leaves.
            engine.reply = None
            window = await client.messages.create(model=MODEL, max_tokens=100_000,
                                                  messages=USER)
        assert stopped.content[0].text == "one two t"  # type: ignore[union-attr]
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "hree")
        assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "two")
        assert streamed.content[0].text == "one "  # type: ignore[union-attr]
        assert (cut.stop_reason, cut.content[0].text) == ("max_tokens", "one ")  # type: ignore[union-attr]
        assert window.stop_reason == "model_context_window_exceeded"
        assert window.usage.input_tokens + window.usage.output_tokens == 256

    run(main)


def test_tool_use_forced_then_a_result_fed_back() -> None:
    async def main() -> None:
        codec = ToolByteCodec()
        engine = FakeEngine(reply=CALL, context_length=1024)
        async with anthropic_client(make_app(engine, codec)) as (client, _):
            message = await client.messages.create(
                model=MODEL, max_tokens=200, messages=USER, tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather",
                             "disable_parallel_tool_use": True})
            async with client.messages.stream(model=MODEL, max_tokens=200, messages=USER,
                                              tools=[WEATHER]) as stream:
                streamed = await stream.get_final_message()
            [call] = message.content
            assert call.type == "tool_use"
            engine.reply = b"It is sunny."
            answer = await client.messages.create(
                model=MODEL, max_tokens=50, tools=[WEATHER], messages=[
                    *USER, message.to_param(),
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                        {"type": "text", "text": "and so?"}]}])
        assert call.id.startswith("toolu_") and call.name == "get_weather"
        assert call.input == {"city": "Paris"}
        assert message.stop_reason == "tool_use" and message.stop_sequence is None
        assert engine.requests[0].params.constraint is not None  # the named tool is forced
        [streamed_call] = streamed.content
        assert streamed_call.type == "tool_use" and streamed_call.input == {"city": "Paris"}
        assert streamed.stop_reason == "tool_use"
        assert (answer.stop_reason, answer.content[0].text) == ("end_turn", "It is sunny.")  # type: ignore[union-attr]
        messages, tools, kwargs = codec.templated[-1]
        assert [m.role for m in messages] == ["user", "assistant", "tool", "user"]
        assert messages[1].tool_calls[0].id == call.id
        assert json.loads(messages[1].tool_calls[0].arguments) == {"city": "Paris"}
        assert (messages[2].tool_call_id, messages[2].content) == (call.id, "sunny")
        assert messages[3].content == "and so?"
        assert tools and tools[0]["function"]["name"] == "get_weather"
        assert kwargs["enable_thinking"] is False  # no 'thinking': Anthropic's default

    run(main)


def test_thinking_blocks_whole_streamed_and_omitted() -> None:
    async def main() -> None:
        codec = ToolByteCodec()
        engine = FakeEngine(reply=b"let me see</think>\n\nThe answer")
        thinking: Any = {"type": "enabled", "budget_tokens": 2048}
        async with anthropic_client(make_app(engine, codec)) as (client, _):
            message = await client.messages.create(model=MODEL, max_tokens=100,
                                                   messages=USER, thinking=thinking)
            async with client.messages.stream(model=MODEL, max_tokens=100, messages=USER,
                                              thinking=thinking) as stream:
                streamed = await stream.get_final_message()
            omitted = await client.messages.create(
                model=MODEL, max_tokens=100, messages=USER,
                thinking={**thinking, "display": "omitted"})
            # Thinking fed back: the template gets it as the turn's reasoning.
            engine.reply = b"ok</think>fine"
            await client.messages.create(model=MODEL, max_tokens=100, thinking=thinking,
                                         messages=[*USER, message.to_param(), *USER])
        for answer in (message, streamed):
            assert [b.type for b in answer.content] == ["thinking", "text"]
            assert answer.content[0].thinking == "let me see"  # type: ignore[union-attr]
            assert answer.content[0].signature == ""  # type: ignore[union-attr]
            assert answer.content[1].text == "The answer"  # type: ignore[union-attr]
        assert omitted.content[0].thinking == ""  # type: ignore[union-attr]
        assert codec.templated[0][2] == {"enable_thinking": True, "reasoning_effort": "low"}
        fed = codec.templated[-1][0][1]
        assert (fed.role, fed.reasoning, fed.content) == ("assistant", "let me see",
                                                          "The answer")

    run(main)


def test_a_thinking_answer_starts_with_its_block_even_when_it_thought_nothing() -> None:
    """The prompt opened the reasoning: the first block is thinking, whole and streamed,
    also where the model ended its turn at once or closed its reasoning first."""
    async def main() -> None:
        engine = FakeEngine(reply=b"")
        thinking: Any = {"type": "enabled", "budget_tokens": 2048}
        answers: dict[bytes, list[Any]] = {}
        async with anthropic_client(make_app(engine, ToolByteCodec())) as (client, _):
            for reply in (b"", b"</think>hello"):
                engine.reply = reply
                message = await client.messages.create(model=MODEL, max_tokens=100,
                                                       messages=USER, thinking=thinking)
                async with client.messages.stream(model=MODEL, max_tokens=100,
                                                  messages=USER, thinking=thinking) as stream:
                    streamed = await stream.get_final_message()
                answers[reply] = [message, streamed]
            # Without thinking, nothing written is no block at all.
            engine.reply = b""
            plain = await client.messages.create(model=MODEL, max_tokens=100, messages=USER)
        for message in answers[b""]:
            assert [(b.type, b.thinking) for b in message.content] == [("thinking", "")]
            assert message.stop_reason == "end_turn"
        for message in answers[b"</think>hello"]:
            assert [b.type for b in message.content] == ["thinking", "text"]
            assert message.content[1].text == "hello"
        assert plain.content == [] and plain.stop_reason == "end_turn"

    run(main)


def test_x_api_key_bearer_and_a_wrong_key() -> None:
    async def main() -> None:
        app = make_app(FakeEngine(reply=b"ok"), api_key=KEY)
        async with anthropic_client(app) as (client, url):
            good = await client.messages.create(model=MODEL, max_tokens=5, messages=USER)
            assert client.api_key == KEY  # sent as x-api-key, Anthropic's header
            async with anthropic.AsyncAnthropic(base_url=url, api_key="sk-wrong",
                                                max_retries=0) as wrong:
                with pytest.raises(anthropic.AuthenticationError) as refused:
                    await wrong.messages.create(model=MODEL, max_tokens=5, messages=USER)
            async with httpx.AsyncClient(base_url=url) as http:
                bearer = await http.post("/v1/messages", json={
                    "model": MODEL, "max_tokens": 5, "messages": USER},
                    headers={"Authorization": f"Bearer {KEY}"})
                models = await http.get("/v1/models", headers={"x-api-key": KEY})
                missing = await http.post("/v1/messages/count_tokens", json={})
                openai_401 = await http.get("/v1/models", headers={"x-api-key": "nope"})
                near = [await http.post("/v1/messages/count_tokens", headers={"x-api-key": k},
                                        json={"model": MODEL, "messages": USER})
                        for k in (KEY + "x", KEY[:-1], KEY.upper(), "")]
        assert good.content[0].text == "ok"  # type: ignore[union-attr]
        assert refused.value.status_code == 401
        assert refused.value.body == {"type": "error", "error": {
            "type": "authentication_error", "message": "invalid API key"}}
        assert bearer.status_code == 200 and models.status_code == 200
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        assert "x-api-key" in missing.json()["error"]["message"]
        assert openai_401.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there
        assert [r.status_code for r in near] == [401] * 4

    run(main)


def test_refusals_in_anthropics_shape() -> None:
    async def main() -> None:
        async with anthropic_client(make_app(FakeEngine(reply=b"ok"))) as (client, url):
            with pytest.raises(anthropic.BadRequestError) as unknown:
                await client.messages.create(model=MODEL, max_tokens=5, messages=USER,
                                             extra_body={"frobnicate": 1})
            with pytest.raises(anthropic.BadRequestError) as server_tool:
                await client.messages.create(
                    model=MODEL, max_tokens=5, messages=USER,
                    tools=[{"type": "web_search_20250305", "name": "web_search"}])
            with pytest.raises(anthropic.BadRequestError) as image:
                await client.messages.create(model=MODEL, max_tokens=5, messages=[
                    {"role": "user", "content": [{"type": "image", "source": {
                        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
            with pytest.raises(anthropic.BadRequestError) as hot:
                await client.messages.create(model=MODEL, max_tokens=5, messages=USER,
                                             extra_body={"temperature": 1.5})
            with pytest.raises(anthropic.NotFoundError) as model:
                await client.messages.create(model="claude-sonnet-4-5", max_tokens=5,
                                             messages=USER)
            async with httpx.AsyncClient(base_url=url) as http:
                no_max = await http.post("/v1/messages", json={"model": MODEL,
                                                                "messages": USER})
                wrong_method = await http.get("/v1/messages")
        for caught, named in ((unknown, "frobnicate"), (server_tool, "web_search_20250305"),
                              (image, "image"), (hot, "temperature")):
            body = caught.value.body
            assert isinstance(body, dict) and body["type"] == "error", body
            assert body["error"]["type"] == "invalid_request_error"
            assert named in body["error"]["message"], body
        assert model.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        assert no_max.status_code == 400 and "max_tokens" in no_max.json()["error"]["message"]
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"

    run(main)


def test_a_model_still_loading_is_overloaded_and_retried_later() -> None:
    async def main() -> None:
        async with serving(make_app(ready=lambda: False)) as url, \
                httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/v1/messages", json={"model": MODEL, "max_tokens": 5,
                                                             "messages": USER})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json() == {"type": "error", "error": {
            "type": "overloaded_error", "message": "the model is still loading; retry shortly"}}

    run(main)


def test_an_engine_failure_mid_stream_is_an_error_event() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"abcdefgh", fail_after=3)
        async with anthropic_client(make_app(engine)) as (client, url):
            with pytest.raises(anthropic.APIStatusError) as failed:
                async with client.messages.stream(model=MODEL, max_tokens=50,
                                                  messages=USER) as stream:
                    async for _ in stream:
                        pass
            async with httpx.AsyncClient(base_url=url) as http:
                whole = await http.post("/v1/messages", json={"model": MODEL, "max_tokens": 5,
                                                              "messages": USER})
        assert "the engine failed" in str(failed.value.body)
        assert whole.status_code == 500
        assert whole.json()["error"]["type"] == "api_error"

    run(main)


def test_count_tokens_is_the_rendered_prompt() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"ok")
        async with anthropic_client(make_app(engine)) as (client, _):
            counted = await client.messages.count_tokens(model=MODEL, system="sys",
                                                         messages=USER)
            answer = await client.messages.create(model=MODEL, max_tokens=5, system="sys",
                                                  messages=USER)
        assert counted.input_tokens == len("<system>sys<user>hi<assistant>")
        assert answer.usage.input_tokens == counted.input_tokens
        assert len(engine.requests) == 1  # counting generates nothing

    run(main)


def test_a_claude_code_request() -> None:
    async def main() -> None:
        codec = ToolByteCodec()
        engine = FakeEngine(reply=b'ok</think><tool_call>{"name": "Bash", "arguments": '
                                  b'{"command": "ls"}}</tool_call>', context_length=2048)
        async with serving(make_app(engine, codec, api_key=KEY)) as url, \
                httpx.AsyncClient(base_url=url) as http:
            body, headers = claude_code_request(MODEL, KEY)
            response = await http.post("/v1/messages?beta=true", json=body, headers=headers)
        assert response.status_code == 200, response.text
        events = sse(response.text)
        starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
        assert starts == ["thinking", "tool_use"]
        [call_json] = [d["delta"]["partial_json"] for n, d in events
                       if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
        assert json.loads(call_json) == {"command": "ls"}
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
        messages, tools, kwargs = codec.templated[0]
        # The billing line is left out: the system prompt is the same every request.
        assert messages[0].content == ("You are Claude Code, Anthropic's official CLI for "
                                       "Claude.\nBe concise.")
        assert messages[1].content == "<system-reminder>context</system-reminder>\nlist the files"
        assert kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
        assert tools and tools[0]["function"]["parameters"]["required"] == ["command"]
        # max_tokens above what the context leaves: as much as it leaves.
        assert engine.requests[0].params.max_tokens == \
            2048 - len(engine.requests[0].prompt_tokens)

    run(main)
