"""``ReplicaEngine`` over two real local engines on the tiny fixture (loaded once for the
module), each behind ``EngineMember``, our fake of the ``Member`` seam: the pool's
outputs, its spread, members down or refusing, affinity and its stats."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mlxceld.engine import EngineUnavailable, GenerationRequest, SamplingParams, TokenOutput
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.replicas.pool import ReplicaEngine
from mlxceld.replicas.routing import BLOCK_TOKENS

from helpers.replicas import EngineMember

PROMPTS = ["Hello, world", "The quick brown fox jumps over", "x", "one two three four"]
N = 12  # tokens per answer


@dataclass
class Loaded:
    engines: tuple[LocalEngine, LocalEngine]
    tokenizer: Any

    def prompt(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def pool(self, kind: type[EngineMember] = EngineMember, **options: Any
             ) -> tuple[ReplicaEngine, list[EngineMember]]:
        members = [kind(engine, f"replica-{i}", address=f"10.9.8.{i + 1}:19100")
                   for i, engine in enumerate(self.engines)]
        return ReplicaEngine(members, model_id="tiny", context_length=2048,
                             **options), members

    def no_eos(self) -> tuple[tuple[int, float], ...]:
        return tuple((t, -100.0) for t in sorted(self.tokenizer.eos_token_ids))


@pytest.fixture(scope="module")
def loaded(fixture_dir: Path) -> Iterator[Loaded]:
    path = str(fixture_dir / "qwen3")
    a, tokenizer = load_local_engine(path, max_batch=4)
    b, _ = load_local_engine(path, max_batch=4)
    try:
        yield Loaded((a, b), tokenizer)
    finally:
        for engine in (a, b):
            asyncio.run(engine.aclose())


def request(rid: str, prompt: list[int], n: int = N, **params: Any) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0,
                                                         **params))


async def tokens(engine: Any, req: GenerationRequest) -> list[int]:
    async with asyncio.timeout(60):
        return [t.token async for t in engine.generate(req)]


async def cut_midway(loaded: Loaded, pool: ReplicaEngine, members: list[EngineMember],
                     prompt: list[int], cut: Callable[[EngineMember, EngineMember], None]
                     ) -> tuple[list[int], list[int], EngineMember, EngineMember]:
    """A 60-token greedy request "long" on ``pool``, and ``cut(holder, other)`` called
    once 5 of its tokens were read (``holder``: the member it runs on): the tokens read,
    one engine's answer alone, and the two members."""
    bias = loaded.no_eos()
    expected = await tokens(loaded.engines[0], request("ref", prompt, n=60, logit_bias=bias))
    got: list[int] = []
    async with asyncio.timeout(60):
        async for out in pool.generate(request("long", prompt, n=60, logit_bias=bias)):
            got.append(out.token)
            if len(got) == 5:
                [holder] = [m for m in members if m.requests == ["long"]]
                other = next(m for m in members if m is not holder)
                cut(holder, other)
    return got, expected, holder, other


def test_outputs_equal_one_engines_and_concurrent_requests_spread(loaded: Loaded) -> None:
    async def run() -> None:
        prompts = [loaded.prompt(p) for p in PROMPTS]
        alone = [await tokens(loaded.engines[0], request("ref", p)) for p in prompts]
        pool, members = loaded.pool()
        assert pool.max_batch == 8
        assert [await tokens(pool, request(f"s{i}", p)) for i, p in enumerate(prompts)] \
            == alone
        got = await asyncio.gather(*(tokens(pool, request(f"c{i}", prompts[i % 4]))
                                     for i in range(8)))
        assert list(got) == [alone[i % 4] for i in range(8)]
        took = [sum(r.startswith("c") for r in m.requests) for m in members]
        assert sum(took) == 8 and min(took) >= 2, took  # both took a share
        stats = pool.stats(verbose=False)
        assert (stats["dispatched"], stats["completed"], stats["in_flight"],
                stats["outstanding_tokens"], stats["failed"]) == (12, 12, 0, 0, 0)
        assert pool.active_sequences() == 0

    asyncio.run(run())


def test_a_member_down_midway_has_its_sequence_continued_on_another(loaded: Loaded) -> None:
    """A member that goes down after tokens were streamed: the request goes on on the other
    member (prompt and tokens sent prefilled there), the client reads the one engine's
    greedy answer whole; the member gets nothing new."""
    async def run() -> None:
        pool, members = loaded.pool()
        prompt = loaded.prompt(PROMPTS[1])
        got, expected, holder, other = await cut_midway(
            loaded, pool, members, prompt,
            lambda holder, _: holder.down(f"no heartbeat from {holder.address} for 5 s"))
        assert got == expected
        assert other.requests == ["long"]
        for i in range(3):
            await tokens(pool, request(f"after{i}", prompt))
        assert holder.requests == ["long"]
        assert other.requests[-3:] == ["after0", "after1", "after2"]
        stats = pool.stats(verbose=False)
        node = next(n for n in stats["nodes"] if n["id"] == holder.node_id)
        assert (node["state"], node["in_flight"], node["outstanding_tokens"]) == \
            ("down", 0, 0)
        assert node["last_error"] == "no heartbeat from <address> for 5 s"
        assert (stats["failed"], stats["completed"]) == (0, 4), stats
        assert pool.continuity().continued_total == 1

    asyncio.run(run())


def test_a_member_down_midway_fails_its_sequence_by_name_when_none_can_go_on(
        loaded: Loaded) -> None:
    """No other member up within the pool's wait, or a request that cannot continue
    exactly elsewhere (a presence penalty counts the tokens the first member generated):
    the member's error, by name."""
    async def run() -> None:
        for other_down, params in ((True, {}), (False, {"presence_penalty": 0.5})):
            pool, members = loaded.pool(continue_wait_s=0.3)
            prompt = loaded.prompt(PROMPTS[1])
            stream = pool.generate(request("long", prompt, n=400, logit_bias=loaded.no_eos(),
                                           **params))
            async with asyncio.timeout(60):
                await anext(stream)
                [holder] = [m for m in members if m.requests == ["long"]]
                other = next(m for m in members if m is not holder)
                if other_down:
                    other.down("silent")
                holder.down(f"no heartbeat from {holder.address} for 5 s")
                with pytest.raises(EngineUnavailable) as caught:
                    async for _ in stream:
                        pass
            message = str(caught.value)
            assert message.startswith(f"replica {holder.node_id!r} failed after ")
            assert "10.9.8." not in message and "<address>" in message
            assert other.requests == []
            node = next(n for n in pool.stats(verbose=False)["nodes"]
                        if n["id"] == holder.node_id)
            assert (node["state"], node["failed"], node["in_flight"],
                    node["outstanding_tokens"]) == ("down", 1, 0, 0)
        assert "no replica is up" not in (pool.readiness() or {}).get("message", "")
        other.down("silent")
        assert "no replica is up: replica-0 down" in pool.readiness()["message"]  # type: ignore[index]

    asyncio.run(run())


def test_a_refusal_before_the_first_token_is_tried_elsewhere_once(loaded: Loaded) -> None:
    async def run() -> None:
        pool, members = loaded.pool()
        prompt = loaded.prompt(PROMPTS[0])
        expected = await tokens(loaded.engines[0], request("ref", prompt))
        members[0].refuse(1)
        assert await tokens(pool, request("r1", prompt)) == expected
        assert (members[0].requests, members[1].requests) == (["r1"], ["r1"])
        for m in members:
            m.refuse(1)
        with pytest.raises(EngineUnavailable) as caught:
            await tokens(pool, request("r2", prompt))
        assert caught.value.retry_after_s == 3
        assert str(caught.value) == (
            "no replica can take the request now: replica-0 refused (the node at "
            "<address> is busy), replica-1 refused (the node at <address> is busy); "
            "retry in 3 s")
        assert (members[0].requests[-1], members[1].requests[-1]) == ("r2", "r2")
        stats = pool.stats(verbose=True)
        assert [n["retried"] for n in stats["nodes"]] == [2, 1]
        assert stats["refused"] == 1 and stats["in_flight"] == 0
        assert stats["nodes"][0]["last_error"] == "the node at 10.9.8.1:19100 is busy"
        assert pool.stats(verbose=False)["nodes"][0]["last_error"] == \
            "the node at <address> is busy"

    asyncio.run(run())


def test_the_same_long_prompt_goes_back_to_the_member_that_holds_it(loaded: Loaded) -> None:
    async def run() -> None:
        pool, members = loaded.pool()
        first = loaded.prompt(" ".join(["alpha beta gamma"] * 20))
        second = loaded.prompt(" ".join(["delta epsilon"] * 25))
        assert min(len(first), len(second)) >= 3 * BLOCK_TOKENS
        # together: the first goes to replica-0, the second to replica-1 (less work)
        await asyncio.gather(tokens(pool, request("a", first)),
                             tokens(pool, request("b", second)))
        assert (members[0].requests, members[1].requests) == (["a"], ["b"])
        # alone, with nothing in flight anywhere: replica-1 holds the second's prefix
        await tokens(pool, request("b-again", second))
        assert members[1].requests == ["b", "b-again"]
        node = pool.stats(verbose=False)["nodes"][1]
        assert node["affinity_hits"] == 1
        assert node["affinity_tokens"] == len(second) // BLOCK_TOKENS * BLOCK_TOKENS

    asyncio.run(run())


@dataclass
class Borrowed(EngineMember):
    """A member over the module's shared engine: closing it leaves the engine open."""

    closed: bool = False

    async def aclose(self) -> None:
        self.closed = True


def test_a_member_added_while_a_request_runs_takes_the_next(loaded: Loaded) -> None:
    async def run() -> None:
        first = Borrowed(loaded.engines[0], "replica-a", address="10.9.8.1:19100")
        pool = ReplicaEngine([first], model_id="tiny", context_length=2048)
        prompt = loaded.prompt(PROMPTS[1])
        expected = await tokens(loaded.engines[1], request("ref", prompt))
        stream = pool.generate(request("long", prompt, n=400, logit_bias=loaded.no_eos()))
        async with asyncio.timeout(60):
            await anext(stream)
            second = Borrowed(loaded.engines[1], "replica-b", address="10.9.8.2:19100")
            pool.add(second)
            assert pool.max_batch == 8
            with pytest.raises(ValueError, match="replica-b is a member"):
                pool.add(Borrowed(loaded.engines[1], "replica-b"))
            assert await tokens(pool, request("next", prompt)) == expected
            assert second.requests == ["next"] and first.requests == ["long"]
            stats = pool.stats(verbose=False)
            assert [(n["id"], n["in_flight"]) for n in stats["nodes"]] == [
                ("replica-a", 1), ("replica-b", 0)]
            assert stats["up"] == 2 and stats["completed"] == 1
            await stream.aclose()
        assert pool.active_sequences() == 0
        await pool.aclose()
        assert first.closed and second.closed

    asyncio.run(run())


def test_a_retired_member_finishes_its_sequence_then_leaves(loaded: Loaded) -> None:
    async def run() -> None:
        members = [Borrowed(engine, f"replica-{i}", address=f"10.9.8.{i + 1}:19100")
                   for i, engine in enumerate(loaded.engines)]
        pool = ReplicaEngine(members, model_id="tiny", context_length=2048)
        prompt = loaded.prompt(PROMPTS[0])
        got = []
        stream = pool.generate(request("long", prompt, n=40, logit_bias=loaded.no_eos()))
        async with asyncio.timeout(60):
            got.append((await anext(stream)).token)
            [holder] = [m for m in members if m.requests == ["long"]]
            other = next(m for m in members if m is not holder)
            pool.retire(holder.node_id)
            assert pool.max_batch == 4 and not holder.closed
            node = next(n for n in pool.stats(verbose=False)["nodes"]
                        if n["id"] == holder.node_id)
            assert node["retired"] and node["in_flight"] == 1
            for i in range(2):  # nothing new goes to it
                await tokens(pool, request(f"after{i}", prompt))
            assert holder.requests == ["long"] and other.requests == ["after0", "after1"]
            got += [out.token async for out in stream]  # it runs to its end
        assert len(got) == 40
        await asyncio.sleep(0.05)  # its close, scheduled once its last sequence ended
        assert holder.closed and not other.closed
        assert [n["id"] for n in pool.stats(verbose=False)["nodes"]] == [other.node_id]
        pool.retire(other.node_id)  # nothing in flight: closed at once
        await asyncio.sleep(0.05)
        assert other.closed and pool.max_batch == 0
        assert "none is known yet" in pool.readiness()["message"]  # type: ignore[index]
        with pytest.raises(EngineUnavailable, match="none is known yet"):
            await tokens(pool, request("none", prompt))
        await pool.aclose()

    asyncio.run(run())


def test_a_retired_member_failing_midway_has_its_sequence_continued(loaded: Loaded) -> None:
    """A member retired from the pool (a replica group a heal dropped) whose stages stop
    under a running sequence: it goes on on a member in the pool, greedy tokens whole."""
    async def run() -> None:
        pool, members = loaded.pool(Borrowed)

        def cut(holder: EngineMember, _: EngineMember) -> None:
            pool.retire(holder.node_id)
            holder.down("its stage stopped")

        got, expected, _, other = await cut_midway(loaded, pool, members,
                                                   loaded.prompt(PROMPTS[2]), cut)
        assert got == expected
        assert other.requests == ["long"]

    asyncio.run(run())


def test_a_sequence_cut_while_no_other_member_is_up_waits_for_one(loaded: Loaded) -> None:
    """A retired member's stages stop under a running sequence at the moment the member in
    the pool is down (its link re-dialed): the sequence waits for it to come up, within
    the pool's wait, and goes on there whole."""
    async def run() -> None:
        pool, members = loaded.pool(Borrowed)

        def cut(holder: EngineMember, other: EngineMember) -> None:
            pool.retire(holder.node_id)
            other.down("re-dialing")
            holder.down("its stage stopped")
            asyncio.get_running_loop().call_later(1.0, other.up)

        got, expected, _, other = await cut_midway(loaded, pool, members,
                                                   loaded.prompt(PROMPTS[3]), cut)
        assert got == expected
        assert other.requests == ["long"]
        stats = pool.stats(verbose=False)
        assert (stats["failed"], stats["completed"]) == (0, 1), stats

    asyncio.run(run())


@dataclass
class Slow(Borrowed):
    """A member whose first token waits for ``go``; ``asked``: a request came."""

    go: asyncio.Event = field(default_factory=asyncio.Event)
    asked: bool = False

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        self.asked = True
        await self.go.wait()
        async for out in super().generate(request):
            yield out


def test_a_member_retired_before_its_first_token_still_answers(loaded: Loaded) -> None:
    """A re-plan retires the member a request was just sent to, before its first token (a
    drain's re-plan under load): the request is answered there, whole."""
    async def run() -> None:
        pool, members = loaded.pool(Slow)
        prompt = loaded.prompt(PROMPTS[0])
        expected = await tokens(loaded.engines[0], request("ref", prompt))
        slow = [m for m in members if isinstance(m, Slow)]
        task = asyncio.ensure_future(tokens(pool, request("r", prompt)))
        async with asyncio.timeout(30):
            while not any(m.asked for m in slow):
                await asyncio.sleep(0.01)
        [holder] = [m for m in slow if m.asked]
        pool.retire(holder.node_id)
        for m in slow:
            m.go.set()
        assert await task == expected
        assert pool.stats(verbose=False)["failed"] == 0

    asyncio.run(run())
