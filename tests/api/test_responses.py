"""``POST /v1/responses`` (OpenAI's Responses API) as the real ``openai`` package sees it:
in process over a fake engine and byte codecs, and once over real uvicorn."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from helpers.api import MODEL, http_client, make_app, openai_client, serving
from helpers.fakes import FakeEngine, ToolByteCodec

WEATHER: Any = {"type": "function", "name": "get_weather", "description": "The weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
REPLY = f"look it up</think>Let me check.<tool_call>{CALL}</tool_call>"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def prompt_text(engine: FakeEngine, i: int = 0) -> str:
    return bytes(engine.requests[i].prompt_tokens).decode()


def test_whole_with_instructions_and_usage() -> None:
    async def main() -> None:
        engine = FakeEngine(reply="Grüße!".encode())
        async with openai_client(make_app(engine)) as client:
            answer = await client.responses.create(model=MODEL, input="hi",
                                                   instructions="be brief", temperature=0.5,
                                                   metadata={"k": "v"})
        assert answer.id.startswith("resp_") and answer.object == "response"
        assert (answer.status, answer.model, answer.output_text) == ("completed", MODEL,
                                                                      "Grüße!")
        [message] = answer.output
        assert message.type == "message" and message.role == "assistant"
        assert message.status == "completed" and message.id.startswith("msg_")
        assert prompt_text(engine) == "<system>be brief<user>hi<assistant>"
        assert engine.requests[0].request_id == answer.id
        assert engine.requests[0].params.temperature == 0.5
        assert answer.usage is not None
        assert answer.usage.input_tokens == len("<system>be brief<user>hi<assistant>")
        assert answer.usage.output_tokens == len("Grüße!".encode()) + 1  # and the EOS
        assert answer.usage.total_tokens == answer.usage.input_tokens + \
            answer.usage.output_tokens
        assert answer.usage.output_tokens_details.reasoning_tokens == 0
        assert answer.usage.input_tokens_details.cached_tokens == 0
        # the request's parameters, echoed as OpenAI does
        assert (answer.instructions, answer.temperature, answer.metadata) == \
            ("be brief", 0.5, {"k": "v"})
        assert answer.tools == [] and answer.tool_choice == "auto"

    asyncio.run(main())


def test_streamed_in_openais_event_sequence() -> None:
    async def main() -> None:
        engine = FakeEngine(reply="naïve café ☕".encode())
        async with openai_client(make_app(engine)) as client:
            stream = await client.responses.create(model=MODEL, input="hi", stream=True)
            events = [e async for e in stream]
        kinds = [e.type for e in events]
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         *["response.output_text.delta"] * len(deltas),
                         "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response  # type: ignore[union-attr]
        assert final.status == "completed"
        assert final.output_text == "".join(deltas) == "naïve café ☕"
        assert events[0].response.status == "in_progress"  # type: ignore[union-attr]
        assert final.usage is not None and final.usage.output_tokens == \
            len("naïve café ☕".encode()) + 1

    asyncio.run(main())


def test_a_list_of_messages_is_the_conversation() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"4")
        conversation: Any = [
            {"role": "developer", "content": "count"},
            {"role": "user", "content": [{"type": "input_text", "text": "1"},
                                         {"type": "input_text", "text": "2"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "3", "annotations": []}]},
            {"role": "user", "content": "next"}]
        async with openai_client(make_app(engine)) as client:
            answer = await client.responses.create(model=MODEL, input=conversation)
        assert answer.output_text == "4"
        assert prompt_text(engine) == \
            "<system>count<user>1\n2<assistant>3<user>next<assistant>"

    asyncio.run(main())


def test_max_output_tokens_makes_it_incomplete() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"a long answer")
        async with openai_client(make_app(engine)) as client:
            answer = await client.responses.create(model=MODEL, input="hi",
                                                   max_output_tokens=4)
            stream = await client.responses.create(model=MODEL, input="hi",
                                                   max_output_tokens=4, stream=True)
            events = [e async for e in stream]
        assert answer.status == "incomplete" and answer.output_text == "a lo"
        assert answer.incomplete_details is not None
        assert answer.incomplete_details.reason == "max_output_tokens"
        assert answer.output[0].status == "incomplete"  # type: ignore[union-attr]
        assert answer.usage is not None and answer.usage.output_tokens == 4
        assert answer.max_output_tokens == 4
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.output_text == "a lo"  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_tool_call_with_reasoning_apart() -> None:
    async def main() -> None:
        engine, codec = FakeEngine(context_length=4096, reply=REPLY.encode()), ToolByteCodec()
        async with openai_client(make_app(engine, codec)) as client:
            answer = await client.responses.create(model=MODEL, input="weather in Paris?",
                                                   tools=[WEATHER])
            stream = await client.responses.create(model=MODEL, input="weather in Paris?",
                                                   tools=[WEATHER], stream=True)
            events = [e async for e in stream]
        reasoning, message, call = answer.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
        assert [c.text for c in reasoning.content or []] == ["look it up"]
        assert answer.output_text == "Let me check."
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and call.status == "completed"
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert message.type == "message"
        assert answer.usage is not None
        assert answer.usage.output_tokens_details.reasoning_tokens == len("look it up")
        [(_, tools, _)] = codec.templated[:1]
        assert tools == [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather",
            "parameters": WEATHER["parameters"]}}]
        assert answer.tools[0].name == "get_weather"  # type: ignore[union-attr]
        # streamed: the reasoning, the message, then the call, each item opened and closed
        kinds = [e.type for e in events]
        assert "".join(e.delta for e in events
                       if e.type == "response.reasoning_text.delta") == "look it up"
        assert kinds.index("response.reasoning_text.done") < \
            kinds.index("response.output_text.delta") < \
            kinds.index("response.function_call_arguments.done")
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [i.type for i in done] == ["reasoning", "message", "function_call"]
        final = events[-1].response  # type: ignore[union-attr]
        assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]

    asyncio.run(main())


def test_a_forced_tool_choice_and_a_tool_result_fed_back() -> None:
    async def main() -> None:
        engine = FakeEngine(context_length=4096, reply=f"</think><tool_call>{CALL}"
                            "</tool_call>".encode())
        codec = ToolByteCodec()
        async with openai_client(make_app(engine, codec)) as client:
            answer = await client.responses.create(
                model=MODEL, input="weather?", tools=[WEATHER],
                tool_choice={"type": "function", "name": "get_weather"})
            [call] = answer.output
            assert call.type == "function_call"
            assert engine.requests[0].params.constraint is not None  # the call is forced
            assert answer.tool_choice.name == "get_weather"  # type: ignore[union-attr]
            engine.reply = b"</think>Sunny."
            history: Any = [{"role": "user", "content": "weather?"},
                            {"type": "reasoning", "id": "rs_1", "summary": [],
                             "content": [{"type": "reasoning_text", "text": "hm"}]},
                            call.model_dump(exclude_none=True),
                            {"type": "function_call_output", "call_id": call.call_id,
                             "output": "sunny, 25 C"}]
            again = await client.responses.create(model=MODEL, input=history,
                                                  tools=[WEATHER])
        assert again.output_text == "Sunny."
        messages, _, _ = codec.templated[-1]
        assert [m.role for m in messages] == ["user", "assistant", "tool"]
        assert messages[1].reasoning == "hm"
        assert [(c.id, c.name) for c in messages[1].tool_calls] == \
            [(call.call_id, "get_weather")]
        assert (messages[2].content, messages[2].tool_call_id) == ("sunny, 25 C",
                                                                   call.call_id)

    asyncio.run(main())


def test_reasoning_effort_goes_to_the_template() -> None:
    async def main() -> None:
        engine, codec = FakeEngine(context_length=4096, reply=b"hi"), ToolByteCodec()
        async with openai_client(make_app(engine, codec)) as client:
            answer = await client.responses.create(model=MODEL, input="hi",
                                                   reasoning={"effort": "none"})
            await client.responses.create(model=MODEL, input="hi",
                                          reasoning={"effort": "high", "summary": "auto"})
        assert [kw for _, _, kw in codec.templated] == [
            {"reasoning_effort": "none", "enable_thinking": False},
            {"reasoning_effort": "high"}]
        assert answer.output_text == "hi"  # thinking off: all of it is content
        assert answer.reasoning is not None and answer.reasoning.effort == "none"

    asyncio.run(main())


def test_text_format_json_schema_constrains_the_answer() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b'{"n":1}')
        async with openai_client(make_app(engine)) as client:
            answer = await client.responses.create(
                model=MODEL, input="a number",
                text={"format": {"type": "json_schema", "name": "num", "schema": SCHEMA,
                                 "strict": True}})
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(
                    model=MODEL, input="x", text={"format": {
                        "type": "json_schema", "name": "bad",
                        "schema": {"type": "string", "format": "no-such-format"}}})
        constraint = engine.requests[0].params.constraint
        assert constraint is not None and constraint.kind == "json_schema"
        assert json.loads(constraint.text) == SCHEMA
        assert json.loads(answer.output_text) == {"n": 1}
        assert answer.text is not None and answer.text.format is not None
        assert answer.text.format.type == "json_schema"
        assert caught.value.body["param"] == "text.format"  # type: ignore[index]

    asyncio.run(main())


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"frobnicate": 1}, "frobnicate"),
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["web_search_call.results"]}, "include[0]"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"reasoning": {"effort": "low", "mode": "pro"}}, "reasoning.mode"),
    ({"text": {"format": {"type": "text", "strict": True}}}, "text.format.strict"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x",
                 "name": "f"}]}, "input[0].name"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
     "input[0].encrypted_content"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED)
def test_refused_by_name(extra: dict[str, Any], param: str) -> None:
    async def main() -> None:
        async with http_client(make_app()) as client:
            reply = await client.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                                             **extra})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert param.split("[")[0].split(".")[0] in error["message"]

    asyncio.run(main())


def test_logprobs_of_the_message_whole_and_streamed() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"abc")
        async with openai_client(make_app(engine)) as client:
            answer = await client.responses.create(
                model=MODEL, input="hi", include=["message.output_text.logprobs"],
                top_logprobs=2)
            stream = await client.responses.create(
                model=MODEL, input="hi", include=["message.output_text.logprobs"],
                stream=True)
            events = [e async for e in stream]
        assert engine.requests[0].params.logprobs == 2 and answer.top_logprobs == 2
        [part] = answer.output[0].content  # type: ignore[union-attr]
        assert part.type == "output_text" and part.logprobs is not None
        assert [(p.token, p.logprob) for p in part.logprobs] == \
            [("a", -0.097), ("b", -0.098), ("c", -0.099)]
        assert [t.token for t in part.logprobs[0].top_logprobs] == ["a", "b"]
        streamed = [(lp.token, lp.logprob) for e in events
                    if e.type == "response.output_text.delta" for lp in e.logprobs]
        [done] = [e for e in events if e.type == "response.output_text.done"]
        assert streamed == [(lp.token, lp.logprob) for lp in done.logprobs] == \
            [("a", -0.097), ("b", -0.098), ("c", -0.099)]
        assert engine.requests[1].params.logprobs == 0

    asyncio.run(main())


def test_accepted_as_documented() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"ok")
        async with openai_client(make_app(engine)) as client:
            answer = await client.responses.create(
                model=MODEL, input="hi", store=False, include=["reasoning.encrypted_content"],
                truncation="disabled", user="u", parallel_tool_calls=False,
                text={"format": {"type": "text"}, "verbosity": "medium"})
        assert answer.output_text == "ok" and answer.user == "u"

    asyncio.run(main())


def test_over_uvicorn_without_v1_and_streamed() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"over the wire")
        async with serving(make_app(engine)) as base:
            client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
            async with client:
                stream = await client.responses.create(model=MODEL, input="hi", stream=True)
                events = [e async for e in stream]
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == "over the wire"  # type: ignore[union-attr]

    asyncio.run(main())


def test_an_engine_failure_mid_stream_is_response_failed() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"abcdef", fail_after=3)
        async with openai_client(make_app(engine)) as client:
            stream = await client.responses.create(model=MODEL, input="hi", stream=True)
            events = [e async for e in stream]
        assert events[-1].type == "response.failed"
        final = events[-1].response  # type: ignore[union-attr]
        assert final.status == "failed" and final.error is not None
        assert "broke down" in final.error.message and final.output_text == "abc"

    asyncio.run(main())


# The Codex CLI's request, as codex-rs builds it (codex-api/src/common.rs,
# ResponsesApiRequest: instructions, developer and user messages of input_text parts,
# flat function tools, tool_choice "auto", store false, stream true, include
# reasoning.encrypted_content, prompt_cache_key, client_metadata), and its second turn
# (the reasoning, the call and its output sent back).
CODEX: dict[str, Any] = {
    "model": MODEL, "instructions": "You are Codex.",
    "input": [{"type": "message", "role": "developer",
               "content": [{"type": "input_text", "text": "<permissions>"}]},
              {"type": "message", "role": "user",
               "content": [{"type": "input_text", "text": "weather in Paris?"}]}],
    "tools": [{**WEATHER, "strict": False}], "tool_choice": "auto",
    "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199a1b2-c3d4", "client_metadata": {"x-codex-turn": "1"}}


def test_the_codex_clis_requests() -> None:
    async def main() -> None:
        engine, codec = FakeEngine(context_length=4096, reply=REPLY.encode()), ToolByteCodec()
        async with http_client(make_app(engine, codec)) as client:
            first = await client.post("/v1/responses", json=CODEX)
            events = sse_named(first.text)
            final = events[-1]["response"]
            turn = [item for item in final["output"] if item["type"] != "message"]
            engine.reply = b"</think>Sunny."
            second = await client.post("/v1/responses", json={**CODEX, "input": [
                *CODEX["input"], *turn,
                {"type": "function_call_output", "call_id": turn[1]["call_id"],
                 "output": "sunny"}]})
        assert first.status_code == 200 and first.headers["content-type"].startswith(
            "text/event-stream")
        assert [i["type"] for i in final["output"]] == ["reasoning", "message",
                                                       "function_call"]
        messages, _, kwargs = codec.templated[-1]
        assert kwargs == {"reasoning_effort": "medium"}
        assert [m.role for m in messages] == ["system", "system", "user", "assistant", "tool"]
        assert messages[3].reasoning == "look it up" and messages[3].tool_calls
        assert sse_named(second.text)[-1]["response"]["output"][-1]["content"][0]["text"] \
            == "Sunny."

    asyncio.run(main())


def sse_named(text: str) -> list[Any]:
    """Each event's data, checked to be named by its type; no [DONE] (OpenAI sends none)."""
    events = []
    for block in text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert text.endswith("\n\n") and "[DONE]" not in text
    return events


@pytest.mark.parametrize("opened", [True, False], ids=["template-opens", "model-opens"])
def test_reasoning_tokens_are_the_ids_between_the_markers(tmp_path: Any, opened: bool) -> None:
    """The count is of the generated ids, not of the reasoning's text re-tokenized: the
    expectation comes from mlx-lm's tokenizer (the markers' ids found in the ids sent),
    over a thought whose characters span several tokens (an emoji, accents, lone
    spaces)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxceld.api import MlxTextCodec
    from mlxceld.models import preset, write_fixture

    tokenizer = load_tokenizer(write_fixture(tmp_path / "qwen3",
                                             preset("tiny", chat_template="tools")))
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    thought = ids(" Hmm,  3 \u00d7 4 = 12 🙂 — café, naïve  ok ")
    sent = [*([] if opened else [*ids("So"), start]), *thought, end, *ids("\n\nTwelve.")]
    expected = sent.index(end) - (0 if opened else sent.index(start) + 1)
    assert expected == len(thought)  # the ids between the markers, as sent
    engine = FakeEngine(context_length=4096, reply=sent)  # type: ignore[arg-type]  # ids

    async def main() -> tuple[Any, list[Any]]:
        async with openai_client(make_app(engine, MlxTextCodec(tokenizer))) as client:
            effort: Any = openai.NOT_GIVEN if opened else {"effort": "none"}
            answer = await client.responses.create(model=MODEL, input="3 \u00d7 4?",
                                                   reasoning=effort)
            stream = await client.responses.create(model=MODEL, input="3 \u00d7 4?",
                                                   reasoning=effort, stream=True)
            return answer, [e async for e in stream]

    answer, events = asyncio.run(main())
    assert answer.output_text.endswith("Twelve.")
    for usage in (answer.usage, events[-1].response.usage):
        assert usage is not None and usage.output_tokens == len(sent) + 1  # and the EOS
        assert usage.output_tokens_details.reasoning_tokens == expected
