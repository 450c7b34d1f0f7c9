"""Lenient where the ecosystem is (issue 29): the request shapes real clients send get
answers through the app, reasoning effort reaches the chat template, the reasoning comes
back under the key the operator picked, and unknown fields may be ignored and named.

The client shapes are ``helpers/clientshapes.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxceld.api import MlxTextCodec
from mlxceld.api.ignoring import HEADER, MAX_NAMED, header_value

from helpers.api import MODEL, http_client, make_app, sse_events
from helpers.clientshapes import CLIENT_SHAPES
from helpers.fakes import FakeEngine, ToolByteCodec

USER = [{"role": "user", "content": "hi"}]


async def post(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"model": MODEL, **body})


@pytest.mark.parametrize("name", sorted(CLIENT_SHAPES))
def test_each_clients_request_shape_gets_an_answer(name: str) -> None:
    async def main() -> None:
        async with http_client(make_app(FakeEngine(reply=b"hello there"))) as client:
            response = await post(client, CLIENT_SHAPES[name])
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert message["content"] == "hello there"

    asyncio.run(main())


def test_the_effort_reaches_the_template_and_the_clients_kwargs_win() -> None:
    """none and minimal set enable_thinking false; every effort is given as
    reasoning_effort; chat_template_kwargs override both."""
    async def main() -> None:
        codec = ToolByteCodec()
        async with http_client(make_app(FakeEngine(reply=b"ok"), codec)) as client:
            for body in ({"reasoning_effort": "none"}, {"reasoning": {"effort": "minimal"}},
                         {"reasoning_effort": "high"}, {"reasoning": {"enabled": False}},
                         {"reasoning_effort": "none",
                          "chat_template_kwargs": {"enable_thinking": True}}, {}):
                response = await post(client, {"messages": USER, "max_tokens": 4, **body})
                assert response.status_code == 200, response.text
        kwargs = [k for _, _, k in codec.templated]
        assert kwargs == [{"reasoning_effort": "none", "enable_thinking": False},
                          {"reasoning_effort": "minimal", "enable_thinking": False},
                          {"reasoning_effort": "high"},
                          {"reasoning_effort": "none", "enable_thinking": False},
                          {"reasoning_effort": "none", "enable_thinking": True}, {}]

    asyncio.run(main())


def test_effort_none_turns_a_qwen3_templates_thinking_off(tmp_path: Path) -> None:
    """The tools fixture's template (Qwen3's way) opens ``<think>`` unless enable_thinking
    is false: effort none closes it, low leaves it open, through the real codec."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxceld.models import preset, write_fixture

    directory = write_fixture(tmp_path / "qwen3", preset("tiny", chat_template="tools"))
    codec = MlxTextCodec(load_tokenizer(directory))
    engine = FakeEngine(context_length=4096)

    async def main() -> None:
        async with http_client(make_app(engine, codec)) as client:
            for effort in ("none", "low"):
                response = await post(client, {"messages": USER, "max_tokens": 2,
                                               "reasoning_effort": effort})
                assert response.status_code == 200, response.text

    asyncio.run(main())
    quiet, thinking = (list(r.prompt_tokens) for r in engine.requests)
    assert not codec.opens_thinking(quiet) and codec.opens_thinking(thinking)


@pytest.mark.parametrize(("field", "keys"), [
    ("reasoning_content", {"reasoning_content"}), ("reasoning", {"reasoning"}),
    ("both", {"reasoning_content", "reasoning"})])
def test_the_reasoning_goes_under_the_operators_key(field: str, keys: set[str]) -> None:
    async def main() -> None:
        engine = FakeEngine(context_length=4096, reply=b"mull</think>answer")
        app = make_app(engine, ToolByteCodec(), reasoning_field=field)
        async with http_client(app) as client:
            whole = await post(client, {"messages": USER, "max_tokens": 40})
            streamed = await post(client, {"messages": USER, "max_tokens": 40,
                                           "stream": True})
        message = whole.json()["choices"][0]["message"]
        assert {k for k in message if k.startswith("reasoning")} == keys
        assert all(message[k] == "mull" for k in keys) and message["content"] == "answer"
        deltas = [e["choices"][0]["delta"] for e in sse_events(streamed.text)
                  if e != "[DONE]" and e["choices"]]
        for key in keys:
            assert "".join(d.get(key, "") for d in deltas) == "mull"
        assert not any(k.startswith("reasoning") and k not in keys for d in deltas for k in d)

    asyncio.run(main())


def test_unknown_fields_are_refused_by_default() -> None:
    async def main() -> None:
        async with http_client(make_app()) as client:
            response = await post(client, {"messages": USER, "x_custom": 1})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "x_custom"
        assert HEADER not in response.headers

    asyncio.run(main())


def test_warn_serves_names_the_ignored_and_logs_each_name_once(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        app = make_app(FakeEngine(reply=b"fine"), unknown_fields="warn")
        async with http_client(app) as client:
            body = {"messages": [{"role": "user", "content": "hi", "x_msg": 1}],
                    "x_custom": {"a": 1}, "max_tokens": 4}
            whole = await post(client, body)
            streamed = await post(client, {**body, "stream": True})
            completion = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "once", "max_tokens": 2, "x_custom": True})
            clean = await post(client, {"messages": USER, "max_tokens": 2})
            refused = await post(client, {**body, "store": True})
        for response in (whole, streamed):
            assert response.status_code == 200, response.text
            assert response.headers[HEADER] == "x_custom, messages[].x_msg"
        assert whole.json()["choices"][0]["message"]["content"] == "fine"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in
                       sse_events(streamed.text) if e != "[DONE]" and e["choices"]) == "fine"
        assert completion.status_code == 200 and completion.headers[HEADER] == "x_custom"
        assert clean.status_code == 200 and HEADER not in clean.headers
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"

    with caplog.at_level(logging.WARNING, logger="mlxceld.api.ignoring"):
        asyncio.run(main())
    logged = [r.getMessage() for r in caplog.records if r.name == "mlxceld.api.ignoring"]
    assert len(logged) == 2, logged
    assert '"x_custom"' in logged[0] and '"messages[].x_msg"' in logged[1]


def test_the_header_is_ascii_and_bounded() -> None:
    names = ["naïve", *(f"f{i}" for i in range(MAX_NAMED + 3))]
    value = header_value(names)
    value.encode("ascii")
    assert value.startswith("na\\u00efve, f0") and value.endswith("and 4 more")


def test_warn_covers_the_responses_and_messages_apis(caplog: pytest.LogCaptureFixture) -> None:
    """The same setting, header and once-per-name log on every endpoint that reads a body:
    unknown fields at the top and inside items, blocks and options are ignored and named,
    whole and streamed; a known field refused is still refused."""
    responses_body: Any = {"model": MODEL, "max_output_tokens": 8, "x_custom": 1,
                           "reasoning": {"effort": "low", "x_knob": True}, "input": [
                               {"role": "user", "content": "hi", "x_item": 1}]}
    messages_body: Any = {"model": MODEL, "max_tokens": 8, "x_custom": 1,
                          "thinking": {"type": "disabled", "x_knob": 1}, "messages": [
                              {"role": "user", "content": [
                                  {"type": "text", "text": "hi", "x_block": 1}]}]}

    async def main() -> list[httpx.Response]:
        app = make_app(FakeEngine(reply=b"fine"), unknown_fields="warn")
        async with http_client(app) as client:
            return [await client.post("/v1/responses", json=responses_body),
                    await client.post("/v1/responses", json={**responses_body,
                                                             "stream": True}),
                    await client.post("/v1/messages", json=messages_body),
                    await client.post("/v1/messages", json={**messages_body, "stream": True}),
                    await client.post("/v1/messages/count_tokens", json={
                        k: v for k, v in messages_body.items() if k != "max_tokens"}),
                    await client.post("/v1/responses", json={**responses_body,
                                                             "store": True}),
                    await client.post("/v1/messages", json={**messages_body,
                                                            "container": "c"})]

    with caplog.at_level(logging.WARNING, logger="mlxceld.api.ignoring"):
        answers = asyncio.run(main())
    whole, streamed, message, message_stream, count, refused, refused_message = answers
    for response in (whole, streamed):
        assert response.status_code == 200, response.text
        assert response.headers[HEADER] == "x_custom, input[].x_item, reasoning.x_knob"
    assert whole.json()["output"][-1]["content"][0]["text"] == "fine"
    assert "event: response.completed" in streamed.text
    for response in (message, message_stream, count):
        assert response.status_code == 200, response.text
        assert response.headers[HEADER] == \
            "x_custom, messages[].content[].x_block, thinking.x_knob"
    assert message.json()["content"] == [{"type": "text", "text": "fine"}]
    assert "event: message_stop" in message_stream.text
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
    assert refused_message.status_code == 400 and HEADER not in refused_message.headers
    assert "'container'" in refused_message.json()["error"]["message"]
    logged = [r.getMessage() for r in caplog.records if r.name == "mlxceld.api.ignoring"]
    assert sorted(n.split('"')[1] for n in logged) == sorted(
        ["x_custom", "input[].x_item", "reasoning.x_knob", "messages[].content[].x_block",
         "thinking.x_knob"]), logged
