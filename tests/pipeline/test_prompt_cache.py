"""The pipeline's prompt cache over real stages and real MXCL: a chat turn by turn, chats
sharing a system prompt at once, a stage that lost what it kept, a small bound, a new
engine (a new plan or a restarted router) and a re-attached stage. Greedy tokens must be
those of a pipeline that keeps nothing, and the cache must actually have been used."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mlxceld.pipeline import PipelineEngine
from mlxceld.pipeline.kvstore import StageCache
from mlxceld.roles.options import KVQuant

from helpers.stages import COORD, Cluster, cluster, tokens_of
from helpers.waiting import until

SPLITS = [(0, 2), (2, 4)]
SYSTEM = [(i * 13) % 400 + 5 for i in range(70)]  # a system prompt every chat opens with


def user_turn(chat: int, turn: int, n: int = 45) -> list[int]:
    return [(chat * 101 + turn * 31 + i * 7) % 450 + 20 for i in range(n)]


async def chat(engine: PipelineEngine, chat_id: int, turns: int, answer: int = 6,
               system: list[int] | None = None,
               between: Callable[[], Awaitable[None]] | None = None) -> list[list[int]]:
    """A chat as a UI holds it: each turn the whole history, the answers included
    (``between``: awaited between turns, as a user takes a while to answer)."""
    history = list(system or [])
    answers = []
    for turn in range(turns):
        if turn and between is not None:
            await between()
        history += [*user_turn(chat_id, turn), 3, 4]  # an end-of-turn, an assistant tag
        out = await tokens_of(engine, history, answer)
        answers.append(out)
        history += [*out, 2]
    return answers


async def settled(c: Cluster, engine: PipelineEngine) -> None:
    """The stages' last ``cache`` answers are in: every entry the router named is held by
    every stage (or dropped)."""
    await until(lambda: engine.prompt_cache_stats()["pending"] == 0
                and engine.prompt_cache_stats()["entries"]
                == min(s.cache.store(COORD).entries for s in c.services),
                "the stages' cache answers", timeout=10)


async def without_cache(path: Path, work: Any) -> Any:
    async with cluster(path, SPLITS) as c:
        engine = c.engine(path, prompt_cache_bytes=0)
        try:
            result = await work(engine)
            assert engine.prompt_cache_stats() == {
                "hits": 0, "misses": 0, "tokens_reused": 0, "entries": 0, "bytes": 0,
                "lost": 0, "pending": 0}
            assert all(s.cache.store(COORD).entries == 0 for s in c.services)
            return result
        finally:
            await engine.aclose()


def test_a_chat_turn_by_turn_reuses_its_history_and_gets_the_same_tokens(
        split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "qwen3"

    async def go() -> tuple[list[list[int]], dict[str, Any], list[int]]:
        async with cluster(path, SPLITS) as c:
            engine = c.engine(path)
            try:
                answers = await chat(engine, 1, 5, between=lambda: settled(c, engine))
                await settled(c, engine)
                return answers, engine.prompt_cache_stats(), [s.cache.store(COORD).stats.hits
                                                        for s in c.services]
            finally:
                await engine.aclose()

    answers, stats, stage_hits = asyncio.run(go())
    assert answers == asyncio.run(without_cache(path, lambda e: chat(e, 1, 5)))
    assert (stats["hits"], stats["misses"], stats["lost"]) == (4, 1, 0)  # all but the 1st
    # Each turn starts from all of the last one but its answer's last token (never run):
    # 47 tokens of a user turn, 6 answered and an end-of-turn.
    assert stats["tokens_reused"] == sum(47 * k + 7 * (k - 1) + 5 for k in range(1, 5))
    assert stage_hits == [4, 4] and stats["bytes"] > 0


def test_chats_at_once_share_a_system_prompt(split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"

    async def work(engine: PipelineEngine) -> list[list[list[int]]]:
        first = [await chat(engine, 0, 1, system=SYSTEM)]  # kept once its prompt is run
        return first + list(await asyncio.gather(*(chat(engine, i, 2, system=SYSTEM)
                                                   for i in (1, 2, 3))))

    async def go() -> tuple[list[list[list[int]]], dict[str, Any]]:
        async with cluster(path, SPLITS) as c:
            engine = c.engine(path)
            try:
                return await work(engine), engine.prompt_cache_stats()
            finally:
                await engine.aclose()

    answers, stats = asyncio.run(go())
    assert answers == asyncio.run(without_cache(path, work))
    # The three chats' first turns start from the first chat's system prompt, their
    # second turns from their own first.
    assert stats["hits"] == 6 and stats["tokens_reused"] >= 3 * len(SYSTEM)


def test_a_stage_that_no_longer_holds_an_entry_means_a_full_prefill(
        split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "qwen3"

    async def go() -> tuple[list[int], list[int], dict[str, Any]]:
        async with cluster(path, SPLITS) as c:
            engine = c.engine(path)
            try:
                prompt = user_turn(5, 0)
                first = await tokens_of(engine, prompt, 5)
                await settled(c, engine)
                c.services[1].cache.store(COORD).clear()  # behind the router's back
                again = await tokens_of(engine, prompt + first + [9, 9, 9], 5)
                return first, again, engine.prompt_cache_stats()
            finally:
                await engine.aclose()

    first, again, stats = asyncio.run(go())
    prompt = user_turn(5, 0)
    want = asyncio.run(without_cache(path, lambda e: asyncio.gather(
        tokens_of(e, prompt, 5), tokens_of(e, prompt + first + [9, 9, 9], 5))))
    assert [first, again] == list(want)
    assert (stats["hits"], stats["misses"], stats["lost"]) == (0, 2, 1)


def test_a_small_bound_evicts_alike_everywhere_and_changes_no_token(
        split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "qwen3"
    prompts = [user_turn(i, 0, 60) for i in range(6)]

    async def work(engine: PipelineEngine) -> list[list[int]]:
        outs = []
        for prompt in prompts + prompts[::-1]:
            outs.append(await tokens_of(engine, prompt, 4))
        return outs

    async def go() -> tuple[list[list[int]], dict[str, Any], list[int], list[int]]:
        async with cluster(path, SPLITS) as c:
            engine = c.engine(path)
            try:
                outs = [await tokens_of(engine, prompts[0], 4)]
                await settled(c, engine)
                for s in c.services:  # room for two entries like that one, no more
                    assert s.cache.store(COORD).entries == 1
                    s.cache.store(COORD).budget = 2 * s.cache.store(COORD).nbytes + 1
                outs += (await work(engine))[1:]
                await settled(c, engine)
                stores = [s.cache.store(COORD) for s in c.services]
                return (outs, engine.prompt_cache_stats(), [s.entries for s in stores],
                        [s.stats.evicted for s in stores])
            finally:
                await engine.aclose()

    outs, stats, entries, evicted = asyncio.run(go())
    assert outs == asyncio.run(without_cache(path, work))
    assert entries == [stats["entries"]] * 2 and 1 <= stats["entries"] <= 2
    assert min(evicted) > 0 and stats["hits"] >= 1


def test_a_new_engine_or_a_reattached_stage_starts_from_nothing(
        split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"
    prompt = user_turn(7, 0)

    async def go() -> tuple[list[list[int]], list[dict[str, Any]], list[int]]:
        async with cluster(path, SPLITS) as c:
            outs, stats, held = [], [], []
            old = c.engine(path)
            try:
                outs.append(await tokens_of(old, prompt, 5))
                await settled(c, old)
                held.append(min(s.cache.store(COORD).entries for s in c.services))
            finally:
                await old.aclose()
            new = c.engine(path)  # a new plan, a live switch, a restarted router
            try:
                outs.append(await tokens_of(new, prompt, 5))
                stats.append(new.prompt_cache_stats())
                await settled(c, new)
                # The stage's connection drops and comes back: it may have restarted.
                await c.stop_stage(1)
                await c.restart_stage(1)
                outs.append(await tokens_of(new, prompt, 5))
                stats.append(new.prompt_cache_stats())
            finally:
                await new.aclose()
            return outs, stats, held

    outs, stats, held = asyncio.run(go())
    assert outs == [outs[0]] * 3
    assert held == [1]  # the old engine's entry, dropped when the new one attached
    assert [s["hits"] for s in stats] == [0, 0]


def test_a_quantized_kv_cache_is_kept_and_reused_alike(kv_fixture_dir: Path) -> None:
    """With ``[serve] kv_bits`` the stages keep and reuse quantized caches: a chat's turns
    get the tokens a pipeline that keeps nothing gets with the same quantized cache."""
    path = kv_fixture_dir / "qwen3"
    kv = KVQuant(8, 64, 0)

    async def go(cache: bool) -> tuple[list[list[int]], dict[str, Any]]:
        async with cluster(path, SPLITS) as c:
            engine = c.engine(path, kv_quant=kv, prompt_cache_bytes=None if cache else 0)
            try:
                answers = await chat(engine, 3, 3, between=lambda: settled(c, engine))
                return answers, dict(engine.prompt_cache_stats())
            finally:
                await engine.aclose()

    cached, stats = asyncio.run(go(True))
    plain, _ = asyncio.run(go(False))
    assert cached == plain
    assert stats["hits"] == 2 and stats["lost"] == 0


def test_a_stage_that_keeps_nothing_means_no_stage_is_asked_to_keep(
        split_fixture_dir: Path) -> None:
    """A stage whose bound is 0 (capped there) refuses every entry, so none could be
    reused: no other stage is asked to copy its caches for it either."""
    path = split_fixture_dir / "llama"

    async def work(engine: PipelineEngine) -> list[list[int]]:
        return await chat(engine, 1, 3)

    async def go() -> tuple[list[list[int]], list[int], list[Any]]:
        async with cluster(path, SPLITS) as c:
            c.services[1].cache = StageCache("stage-1", 0, cap=0)
            engine = c.engine(path)
            try:
                outs = await work(engine)
                await asyncio.sleep(0.2)  # any keep's answer in
                budgets = [s["prompt_cache"]["budget"] for s in engine.stages()]
                return outs, [s.cache.store(COORD).entries for s in c.services], budgets
            finally:
                await engine.aclose()

    outs, entries, budgets = asyncio.run(go())
    assert budgets[1] == 0 and budgets[0] != 0
    assert entries == [0, 0]
    assert outs == asyncio.run(without_cache(path, work))
