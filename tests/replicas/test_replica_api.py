"""A replica pool behind the router's HTTP app (the real ``openai`` client and httpx over
ASGI), over members that are our fakes (``FakeEngine`` in ``EngineMember``): 503 with
Retry-After when no replica can take a request, ``GET /router/stats`` redacted or
verbose; and the pool's own seams (a closed stream, link keepers, rekey, close)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from mlxceld.api.app import STATS_VERBOSE_ENV, stats_verbose
from mlxceld.engine import EngineError, GenerationRequest, SamplingParams
from mlxceld.replicas.pool import DOWN_RETRY_AFTER_S, ReplicaEngine

from helpers.api import KEY, MODEL, http_client, make_app, openai_client, sse_events
from helpers.fakes import FakeEngine
from helpers.replicas import EngineMember
from helpers.waiting import until

ADDRESSES = ("10.0.0.21:19100", "node-b.example:19100")


def pool(**fake: Any) -> tuple[ReplicaEngine, list[EngineMember]]:
    members = [EngineMember(FakeEngine(**fake), f"replica-{i}", address=address)
               for i, address in enumerate(ADDRESSES)]
    return ReplicaEngine(members, model_id=MODEL, context_length=256), members


def app_over(engine: ReplicaEngine) -> Any:
    return make_app(engine, api_key=KEY, router_stats=lambda verbose: engine.stats(
        verbose=verbose), readiness=engine.readiness)


def test_no_replica_up_is_503_with_retry_after_naming_each_by_id() -> None:
    engine, members = pool()
    members[0].down(f"no answer from {ADDRESSES[0]} in 5 s")
    members[1].down("connection refused by [fd00::2]:19100")

    async def run() -> None:
        app = app_over(engine)
        async with openai_client(app) as client:
            with pytest.raises(openai.InternalServerError) as caught:
                await client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        refused = caught.value
        assert refused.status_code == 503
        assert refused.response.headers["retry-after"] == str(DOWN_RETRY_AFTER_S)
        body = refused.response.json()["error"]
        assert body["code"] == "engine_unavailable"
        assert body["message"] == (
            "no replica can take the request now: replica-0 down (no answer from "
            "<address> in 5 s), replica-1 down (connection refused by <address>); retry "
            f"in {DOWN_RETRY_AFTER_S} s")
        async with http_client(app, KEY) as http:
            ready = await http.get("/ready")
            assert ready.status_code == 503 and "10.0.0" not in ready.text
            assert ready.json()["message"].startswith("no replica is up: replica-0 down")
            members[1].up()
            assert (await http.get("/ready")).status_code == 200
            done = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                            "max_tokens": 4})
            assert done.status_code == 200, done.text
        assert engine.stats(verbose=False)["refused"] == 1

    asyncio.run(run())


def test_router_stats_redacted_unless_verbose(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, members = pool()
    members[0].down(f"the link to {ADDRESSES[0]} broke; node-b.example was told")

    async def run() -> tuple[Any, Any]:
        monkeypatch.delenv(STATS_VERBOSE_ENV, raising=False)
        redacted_app = app_over(engine)
        monkeypatch.setenv(STATS_VERBOSE_ENV, "Yes")
        verbose_app = app_over(engine)
        async with http_client(redacted_app) as anonymous:
            assert (await anonymous.get("/router/stats")).status_code == 401
        async with http_client(redacted_app, KEY) as http:
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "max_tokens": 3})
            redacted = await http.get("/router/stats")
        async with http_client(verbose_app, KEY) as http:
            verbose = await http.get("/router/stats")
        async with http_client(make_app(engine, api_key=KEY), KEY) as http:
            assert (await http.get("/router/stats")).status_code == 404  # no pool: no route
        return redacted, verbose

    redacted, verbose = asyncio.run(run())
    assert redacted.status_code == verbose.status_code == 200
    for address in ADDRESSES:
        assert address.split(":")[0] not in redacted.text
    body = redacted.json()
    assert body["addresses_redacted"] is True
    assert [(n["id"], n["state"], n["dispatched"], n["completed"]) for n in body["nodes"]] \
        == [("replica-0", "down", 0, 0), ("replica-1", "up", 1, 1)]
    assert body["nodes"][0]["last_error"] == "the link to <address> broke; <address> was told"
    assert set(body["nodes"][1]) == {
        "id", "role", "state", "in_flight", "outstanding_tokens", "dispatched", "completed",
        "cancelled", "failed", "retried", "affinity_hits", "affinity_tokens", "last_error"}
    assert (body["dispatched"], body["completed"], body["up"]) == (1, 1, 1)
    loud = verbose.json()
    assert loud["addresses_redacted"] is False
    assert [n["address"] for n in loud["nodes"]] == list(ADDRESSES)
    assert ADDRESSES[0] in loud["nodes"][0]["last_error"]
    json.dumps(loud)  # plain JSON


@pytest.mark.parametrize(("value", "verbose"), [
    ("1", True), ("true", True), ("TRUE", True), (" on ", True), ("Yes", True),
    ("", False), ("0", False), ("no", False), ("2", False), (None, False)])
def test_stats_verbose_reads_the_variable(value: str | None, verbose: bool) -> None:
    environ = {} if value is None else {STATS_VERBOSE_ENV: value}
    assert stats_verbose(environ) is verbose


def test_closing_the_stream_cancels_the_sequence_on_its_member() -> None:
    engine, members = pool(stall_after=2)

    async def run() -> None:
        stream = engine.generate(GenerationRequest("r", [1, 2, 3], SamplingParams(8)))
        async with asyncio.timeout(10):
            assert [(await anext(stream)).token for _ in range(2)] == [1, 2]
            await stream.aclose()
        fake = members[0].engine
        assert isinstance(fake, FakeEngine)
        assert fake.cancelled == ["r"] and fake.active == 0
        stats = engine.stats(verbose=False)
        assert (stats["cancelled"], stats["in_flight"], stats["outstanding_tokens"]) == \
            (1, 0, 0)

    asyncio.run(run())


def test_a_failure_after_tokens_is_not_retried_and_names_the_replica() -> None:
    engine, members = pool(fail_after=2)

    async def run() -> None:
        got: list[int] = []
        with pytest.raises(EngineError) as caught:
            async with asyncio.timeout(10):
                async for out in engine.generate(
                        GenerationRequest("r", [5, 6, 7], SamplingParams(8))):
                    got.append(out.token)
        assert got == [5, 6]
        assert str(caught.value) == ("replica 'replica-0' failed after 2 tokens of this "
                                     "answer: the fake engine broke down")
        assert members[1].requests == []
        assert engine.stats(verbose=False)["nodes"][0]["failed"] == 1

    asyncio.run(run())


def test_a_replica_down_mid_stream_is_an_error_event_naming_it() -> None:
    """A request that cannot go on on another replica (a presence penalty counts the
    tokens the first one generated: ``engine/continuation.py``) ends with an SSE error
    event naming the replica that went down."""
    engine, members = pool(reply=b"abcdef", stall_after=3)

    async def run() -> str:
        async with http_client(app_over(engine), KEY) as http:
            streamed = asyncio.create_task(http.post("/v1/completions", json={
                "model": MODEL, "prompt": "p", "stream": True, "max_tokens": 10,
                "presence_penalty": 0.5}))
            await until(lambda: engine.stats(verbose=False)["nodes"][0]["outstanding_tokens"]
                        == 10 - 3, "three tokens through the pool", timeout=30)
            members[0].down(f"no heartbeat from {ADDRESSES[0]}")
            fake = members[0].engine
            assert isinstance(fake, FakeEngine)
            fake.release.set()
            async with asyncio.timeout(30):
                return (await streamed).text

    events = sse_events(asyncio.run(run()))
    assert [e["choices"][0]["text"] for e in events[:3]] == ["a", "b", "c"]
    error = events[3]["error"]
    assert error["code"] == "engine_unavailable"
    assert error["message"] == (
        "replica 'replica-0' failed after 3 tokens of this answer: the link to <address> "
        "broke: no heartbeat from <address>")
    assert events[4:] == ["[DONE]"]
    assert members[1].requests == []  # not continued there


class Linked(EngineMember):
    """A member with a link keeper, as ``RemoteEngine`` has."""

    started = 0
    stopped = 0

    async def keep_linked(self) -> None:
        Linked.started += 1
        try:
            await asyncio.Event().wait()
        finally:
            Linked.stopped += 1


def test_keep_linked_rekey_and_close_reach_every_member() -> None:
    members = [Linked(FakeEngine(), "replica-0"), EngineMember(FakeEngine(), "replica-1")]
    engine = ReplicaEngine(members, model_id=MODEL, context_length=256)

    async def run() -> None:
        task = asyncio.create_task(engine.keep_linked())
        await asyncio.sleep(0.05)
        assert not task.done() and Linked.started == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert Linked.stopped == 1
        engine.rekey()
        assert [m.rekeyed for m in members] == [1, 1]
        await engine.aclose()
        assert all(isinstance(m.engine, FakeEngine) and m.engine.closed for m in members)

    asyncio.run(run())
    with pytest.raises(ValueError, match="distinct node ids"):
        ReplicaEngine([members[0], members[0]], model_id=MODEL, context_length=256)
    empty = ReplicaEngine([], model_id=MODEL, context_length=256)  # discovery fills it
    assert empty.max_batch == 0
    assert "none is known yet" in empty.readiness()["message"]  # type: ignore[index]


def test_members_added_and_retired_while_linked_have_their_keepers_started_and_ended(
        ) -> None:
    async def run() -> None:
        engine = ReplicaEngine([], model_id=MODEL, context_length=256)
        Linked.started = Linked.stopped = 0
        task = asyncio.create_task(engine.keep_linked())
        await asyncio.sleep(0.05)
        added = [Linked(FakeEngine(), "replica-a"), Linked(FakeEngine(), "replica-b")]
        for member in added:
            engine.add(member)
        await asyncio.sleep(0.05)
        assert (Linked.started, Linked.stopped) == (2, 0)
        assert engine.max_batch == sum(m.max_batch for m in added)
        engine.retire("replica-a")  # nothing in flight: its keeper ends, it is closed
        await asyncio.sleep(0.05)
        assert (Linked.started, Linked.stopped) == (2, 1) and not task.done()
        fake = added[0].engine
        assert isinstance(fake, FakeEngine) and fake.closed
        assert [n["id"] for n in engine.stats(verbose=False)["nodes"]] == ["replica-b"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert Linked.stopped == 2
        await engine.aclose()

    asyncio.run(run())
