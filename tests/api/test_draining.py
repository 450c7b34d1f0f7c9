"""The router's side of a drain (``api/edge/draining.py``), over a fake engine in process: new
requests get 503 + Retry-After + "draining" naming the node, a request admitted before
runs to completion, the deadline ends what still runs with a clear error, an undrain
admits again."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator

import pytest

from mlxceld.api.edge.draining import RETRY_AFTER_S, Draining, NodeDrain
from mlxceld.api.errors import ApiError

from helpers.api import MODEL, http_client, make_app
from helpers.fakes import FakeEngine
from helpers.waiting import until

pytestmark = pytest.mark.timeout(30)

STREAM = {"model": MODEL, "prompt": "x", "max_tokens": 6, "stream": True}


def data_lines(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_new_requests_are_refused_and_the_one_running_finishes() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"abcdef", stall_after=2)
        draining = Draining()
        async with http_client(make_app(engine, draining=draining)) as client:
            running = asyncio.ensure_future(client.post("/v1/completions", json=STREAM))
            await until(lambda: engine.active, "the first request to start")
            draining.set([NodeDrain("node-a", None)])
            refused = await client.post("/v1/completions", json={**STREAM, "stream": False})
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
            error = refused.json()["error"]
            assert error["code"] == "draining"
            assert "node node-a draining" in error["message"]
            ready = await client.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            assert draining.in_flight == 1
            engine.release.set()
            answer = await running
            assert "".join(json.loads(d)["choices"][0]["text"]
                           for d in data_lines(answer.text)[:-1]) == "abcdef"
            assert (draining.in_flight, draining.finished, draining.ended) == (0, 1, 0)
            draining.set([])  # undrained: admitted again
            again = await client.post("/v1/completions", json={**STREAM, "stream": False})
            assert again.status_code == 200 and again.json()["choices"][0]["text"] == "abcdef"
            assert (await client.get("/ready")).status_code == 200

    asyncio.run(main())


@pytest.mark.parametrize("stream", [True, False])
def test_the_deadline_ends_what_still_runs_with_a_clear_error(stream: bool) -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"abcdef", stall_after=2)
        draining = Draining()
        async with http_client(make_app(engine, draining=draining)) as client:
            running = asyncio.ensure_future(
                client.post("/v1/completions", json={**STREAM, "stream": stream}))
            await until(lambda: engine.active, "the request to start")
            draining.set([NodeDrain("node-a", time.time() + 0.2)])
            answer = await asyncio.wait_for(running, 5)
            if stream:  # begun: an SSE error event, then [DONE]
                error = json.loads(data_lines(answer.text)[-2])["error"]
            else:
                assert answer.status_code == 503
                error = answer.json()["error"]
            assert error["code"] == "drain_deadline"
            assert "node node-a is draining" in error["message"]
            assert "deadline" in error["message"]
            await until(lambda: engine.cancelled, "the engine's sequence to end")
            assert (draining.in_flight, draining.finished, draining.ended) == (0, 0, 1)

    asyncio.run(main())


def test_two_drains_at_once_arm_the_earliest_deadline() -> None:
    """Node a's deadline comes first (0.3 s), node b's in an hour: a request still
    waiting is ended at a's, naming a."""
    async def never() -> AsyncGenerator[int, None]:
        await asyncio.Event().wait()
        yield 0

    async def main() -> None:
        draining = Draining()
        now = time.time()
        draining.set([NodeDrain("node-b", now + 3600), NodeDrain("node-a", now + 0.3)])
        with pytest.raises(ApiError) as caught:
            await asyncio.wait_for(draining.next_output(never()), 20)
        assert caught.value.code == "drain_deadline"
        assert "node node-a" in caught.value.message

    asyncio.run(main())
