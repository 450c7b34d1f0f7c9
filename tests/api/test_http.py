"""The router app over raw HTTP: refusals, SSE bytes, metrics, readiness, the queue."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxceld.api import ChatMessage

from helpers.api import (
    BASE,
    MODEL,
    http_client,
    make_app,
    metric,
    sse_events,
    until_metric,
)
from helpers.fakes import ByteCodec, FakeEngine
from helpers.waiting import until

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def post(client: httpx.AsyncClient, path: str, body: Any, **kwargs: Any) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> Any:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def test_malformed_requests_and_unknown_paths() -> None:
    async def main() -> None:
        async with http_client(make_app()) as client:
            bad_json = await post(client, "/v1/chat/completions", b'{"messages": [')
            assert_openai_error(bad_json, 400)
            empty = await post(client, "/v1/chat/completions", {**CHAT, "messages": []})
            assert assert_openai_error(empty, 400)["param"] == "messages"
            tool = await post(client, "/v1/chat/completions",
                              {"messages": [{"role": "tool", "content": "1"}]})
            assert "knows no role" in assert_openai_error(tool, 400)["message"]
            no_prompt = await post(client, "/v1/completions", {"prompt": ""})
            assert assert_openai_error(no_prompt, 400)["param"] == "prompt"
            unknown = await client.get("/v1/engines")
            assert "GET /v1/engines" in assert_openai_error(unknown, 404, "unknown_url")["message"]
            wrong_method = await client.get("/v1/completions")
            assert_openai_error(wrong_method, 405, "method_not_allowed")
            assert wrong_method.headers["allow"] == "POST"
            unknown_model = await client.get("/v1/models/other/model")
            assert_openai_error(unknown_model, 404, "model_not_found")

    asyncio.run(main())


def test_oversized_bodies_are_refused_while_read() -> None:
    async def chunks(size: int) -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(size // 1000):
            yield b"x" * 1000
        yield b'"}'

    async def main() -> None:
        engine = FakeEngine(context_length=10_000)
        async with http_client(make_app(engine, max_body_bytes=10_000)) as client:
            declared = await post(client, "/v1/completions", {"prompt": "x" * 20_000})
            assert_openai_error(declared, 413, "request_too_large")
            streamed = await client.post("/v1/completions", content=chunks(50_000))
            assert "content-length" not in streamed.request.headers
            assert_openai_error(streamed, 413, "request_too_large")
            small = await client.post("/v1/completions", content=chunks(5_000),
                                      params={"ignored": "1"})
            assert small.status_code == 200
        assert len(engine.requests) == 1

    asyncio.run(main())


def test_sse_bytes_of_a_chat_stream() -> None:
    async def main() -> None:
        async with http_client(make_app(FakeEngine(reply=b"hey"))) as client:
            response = await post(client, "/v1/chat/completions", {**CHAT, "stream": True})
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert deltas == [{"role": "assistant", "content": ""}, {"content": "h"},
                          {"content": "e"}, {"content": "y"}, {}]
        assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "stop"
        assert all("usage" not in e for e in events[:-1])

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_fails_at_once_is_a_500(stream: bool) -> None:
    async def main() -> None:
        engine = FakeEngine(fail_after=0)
        async with http_client(make_app(engine)) as client:
            response = await post(client, "/v1/completions",
                                  {"prompt": "abc", "stream": stream})
        error = assert_openai_error(response, 500, "engine_error")
        assert error["type"] == "server_error" and "broke down" in error["message"]

    asyncio.run(main())


def test_an_engine_that_fails_mid_stream_sends_an_error_event_then_done() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"abcdef", fail_after=3)
        async with http_client(make_app(engine)) as client:
            streamed = await post(client, "/v1/completions", {"prompt": "p", "stream": True})
            whole = await post(client, "/v1/completions", {"prompt": "p"})
        events = sse_events(streamed.text)
        assert [e["choices"][0]["text"] for e in events[:3]] == ["a", "b", "c"]
        assert events[3]["error"]["code"] == "engine_error"
        assert events[4:] == ["[DONE]"]
        assert_openai_error(whole, 500, "engine_error")

    asyncio.run(main())


class ExplodingCodec(ByteCodec):
    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        raise RuntimeError("a bug in a codec")


def test_a_bug_is_a_500_in_openai_shape() -> None:
    async def main() -> None:
        transport = httpx.ASGITransport(app=make_app(codec=ExplodingCodec()),
                                        raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url=BASE) as client:
            response = await post(client, "/v1/chat/completions", CHAT)
        assert_openai_error(response, 500, "internal_error")

    asyncio.run(main())


def test_health_and_readiness() -> None:
    async def main() -> None:
        ready = False
        engine = FakeEngine(reply=b"ok")
        async with http_client(make_app(engine, ready=lambda: ready)) as client:
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ready")).status_code == 503
            refused = await post(client, "/v1/chat/completions", CHAT)
            assert_openai_error(refused, 503, "not_ready")
            assert refused.headers["retry-after"] == "1"
            ready = True
            assert (await client.get("/ready")).status_code == 200
            assert (await post(client, "/v1/chat/completions", CHAT)).status_code == 200

    asyncio.run(main())


def test_readiness_problems_show_on_ready_but_do_not_gate_completions() -> None:
    """A pipeline with a stage down: /ready is 503 naming it, yet completions still try
    (the engine answers with its own, specific 503)."""
    async def main() -> None:
        problem: dict[str, Any] | None = {"message": "1 of 2 stages not attached: s1 is "
                                                     "unreachable", "stages": [{"stage": "s1"}]}
        async with http_client(make_app(FakeEngine(reply=b"ok"),
                                        readiness=lambda: problem)) as client:
            down = await client.get("/ready")
            assert down.status_code == 503
            assert down.json() == {"status": "degraded", **(problem or {})}
            assert (await post(client, "/v1/chat/completions", CHAT)).status_code == 200
            problem = None
            up = await client.get("/ready")
            assert up.status_code == 200 and up.json() == {"status": "ready"}

    asyncio.run(main())


def test_metrics() -> None:
    async def main() -> None:
        async with http_client(make_app(FakeEngine())) as client:
            await post(client, "/v1/completions", {"prompt": "abcd", "max_tokens": 5})
            await post(client, "/v1/completions", {"prompt": "ab", "max_tokens": 3,
                                                   "stream": True})
            await post(client, "/v1/completions", {"prompt": ""})
            await client.get("/no/such/path")
            response = await client.get("/metrics")
        assert response.headers["content-type"].startswith("text/plain")
        text = response.text
        requests = 'mlxceld_http_requests_total{endpoint="%s",status="%s"}'
        assert metric(text, requests % ("/v1/completions", "200")) == 2
        assert metric(text, requests % ("/v1/completions", "400")) == 1
        assert metric(text, requests % ("other", "404")) == 1
        assert metric(text, "mlxceld_prompt_tokens_total") == 6
        assert metric(text, "mlxceld_completion_tokens_total") == 8
        assert metric(text, "mlxceld_time_to_first_token_seconds_count") == 2
        assert metric(text, "mlxceld_inter_token_latency_seconds_count") == 6
        assert metric(text, "mlxceld_queue_depth") == 0
        assert metric(text, "mlxceld_active_sequences") == 0

    asyncio.run(main())


def test_a_full_queue_is_a_503_with_retry_after() -> None:
    async def main() -> None:
        engine = FakeEngine(max_batch=1, stall_after=1)
        async with http_client(make_app(engine, max_queued=1)) as client:
            async with asyncio.TaskGroup() as tg:
                running = tg.create_task(post(client, "/v1/completions", {"prompt": "a"}))
                await until(lambda: engine.active == 1, "the first sequence to run")
                queued = tg.create_task(post(client, "/v1/completions", {"prompt": "b"}))
                text = await until_metric(client, "mlxceld_queue_depth", 1)
                assert metric(text, "mlxceld_active_sequences") == 1
                refused = await post(client, "/v1/completions", {"prompt": "c"})
                error = assert_openai_error(refused, 503, "overloaded")
                assert refused.headers["retry-after"] == "1"
                assert error["type"] == "server_error"
                engine.release.set()
            assert running.result().status_code == queued.result().status_code == 200
            text = (await client.get("/metrics")).text
        assert metric(text, "mlxceld_active_sequences") == 0
        assert [r.prompt_tokens for r in engine.requests] == [[ord("a")], [ord("b")]]

    asyncio.run(main())


def test_concurrent_requests_never_exceed_max_batch() -> None:
    async def main() -> None:
        engine = FakeEngine(max_batch=2, delay_s=0.001)
        async with http_client(make_app(engine)) as client:
            answers = await asyncio.gather(*(
                post(client, "/v1/completions", {"prompt": f"p{i}", "max_tokens": 4,
                                                 "stream": i % 2 == 0})
                for i in range(10)))
        assert [a.status_code for a in answers] == [200] * 10
        assert engine.peak == 2 and engine.active == 0

    asyncio.run(main())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       st.dictionaries(st.sampled_from(["messages", "prompt", "max_tokens", "stop", "stream",
                                        "temperature", "model", "n", "stream_options"]),
                       json_values, max_size=5))
def test_fuzz_the_app_never_fails_outside_openai_errors(path: str, body: dict[str, Any]) -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"ok")
        async with http_client(make_app(engine)) as client:
            response = await post(client, path, body)
        if response.status_code != 200:
            assert_openai_error(response, response.status_code)
            assert response.status_code in {400, 404, 413}
        assert engine.active == 0

    asyncio.run(main())
