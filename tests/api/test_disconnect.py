"""A client that goes away: real uvicorn on loopback, so that closing the connection
reaches the app as ``http.disconnect``. The engine's sequence is cancelled and the
admission slot freed, whether the client was streaming (from each chat-shaped endpoint:
chat, Responses, Messages), waiting whole, or queued."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from helpers.api import MODEL, make_app, metric, serving, until_metric
from helpers.fakes import FakeEngine
from helpers.waiting import until

pytestmark = pytest.mark.timeout(30)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _chat_text(event: Any) -> str | None:
    return event["choices"][0]["delta"].get("content") if event["choices"] else None


def _responses_text(event: Any) -> str | None:
    return event["delta"] if event["type"] == "response.output_text.delta" else None


def _messages_text(event: Any) -> str | None:
    delta = event.get("delta", {})
    return delta.get("text") if event["type"] == "content_block_delta" else None


# The chat-shaped endpoints, which share the plumbing (answering.SequenceResponse): a body,
# and what text an event of its stream carries.
ENDPOINTS: Any = {
    "/v1/chat/completions": (CHAT, _chat_text),
    "/v1/responses": ({"model": MODEL, "input": "hi"}, _responses_text),
    "/v1/messages": ({"model": MODEL, "max_tokens": 20,
                      "messages": [{"role": "user", "content": "hi"}]}, _messages_text),
}


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_leaving_mid_stream_cancels_the_sequence_and_frees_the_slot(path: str) -> None:
    body, text_of = ENDPOINTS[path]

    async def main() -> None:
        engine = FakeEngine(max_batch=1, reply=b"abcdef", stall_after=2)
        async with serving(make_app(engine)) as url, httpx.AsyncClient(base_url=url) as client:
            seen: list[str] = []
            async with client.stream("POST", path, json={**body, "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    text = text_of(json.loads(line[6:])) if line.startswith("data: ") \
                        else None
                    if text:
                        seen.append(text)
                    if len(seen) == 2:  # "a", "b"; then the engine stalls
                        break
            assert seen == ["a", "b"]
            await until(lambda: engine.cancelled, "the sequence to be cancelled")
            assert engine.cancelled == [engine.requests[0].request_id]
            await until_metric(client, "mlxceld_active_sequences", 0)
            engine.stall_after = None  # the one slot is free: the next request runs
            again = await client.post(path, json=body)
            assert again.status_code == 200 and "abcdef" in again.text, again.text

    asyncio.run(main())


def test_leaving_a_whole_answer_cancels_the_sequence() -> None:
    async def main() -> None:
        engine = FakeEngine(max_batch=1, stall_after=1)
        async with serving(make_app(engine)) as url, httpx.AsyncClient(base_url=url) as client:
            waiting = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x"}))
            await until(lambda: engine.active, "the sequence to start")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await until(lambda: engine.cancelled, "the sequence to be cancelled")
            text = await until_metric(client, "mlxceld_active_sequences", 0)
        status = 'mlxceld_http_requests_total{endpoint="/v1/completions",status="499"}'
        assert metric(text, status) == 1

    asyncio.run(main())


def test_leaving_the_queue_frees_the_place_and_never_reaches_the_engine() -> None:
    async def main() -> None:
        engine = FakeEngine(max_batch=1, stall_after=0)
        app = make_app(engine, max_queued=1)
        async with serving(app) as url, httpx.AsyncClient(base_url=url) as client:
            running = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a"}))
            await until(lambda: engine.active, "the first sequence to start")
            queued = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "b"}))
            await until_metric(client, "mlxceld_queue_depth", 1)
            queued.cancel()
            await until_metric(client, "mlxceld_queue_depth", 0)
            engine.release.set()
            assert (await running).status_code == 200
            with pytest.raises(asyncio.CancelledError):
                await queued
        assert len(engine.requests) == 1 and engine.cancelled == []

    asyncio.run(main())
