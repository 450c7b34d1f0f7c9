"""The prompt cache over a pipeline whose stages are tensor-parallel groups (issue 32's 2D
mesh: two stages of two ranks, real stage workers and real MXCL,
tests/helpers/mesh_stages.py): rank 0 of each stage keeps and reuses entries as any stage,
and its follower mirrors every change (pipeline/kvmirror.py).

A chat turn by turn, each turn the whole history as a client sends it, gets the greedy
tokens of the same pipeline keeping nothing, while every stage counts a hit and the
tokens reused on each turn after the first and each follower holds the entries its rank
0 holds; so with the last stage speculating (its rank 0's draft, every rank trimming
each pass alike), with a quantized KV cache (kv_bits), and under a bound small enough to
evict (prompts, then the same prompts again in reverse: hits after evictions)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from mlxceld.engine import GenerationRequest, SamplingParams
from mlxceld.pipeline import PipelineEngine
from mlxceld.roles.options import KVQuant
from mlxceld.workers.stage import STATS_EVERY_S

from helpers.drafts import write_pairs
from helpers.mesh_stages import MeshStages, mesh_stages
from helpers.waiting import until, wait_for

SPLITS = [(0, 2), (2, 4)]
TURNS, ANSWER = 3, 6
KV = KVQuant(4, 32, 0)
STAGES = ("0/stage", "1/stage")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random target whose tokens depend on the whole context (``plain``), with heads of
    64 elements (a quantized KV cache fits them); it drafts for itself."""
    return write_pairs(tmp_path_factory.mktemp("meshcache"), 4, head_dim=64)


def user_turn(chat: int, turn: int, n: int = 30) -> list[int]:
    return [(chat * 101 + turn * 31 + i * 7) % 400 + 20 for i in range(n)]


async def tokens_of(engine: PipelineEngine, prompt: list[int], n: int, spec: bool) -> list[int]:
    """Greedy tokens; ``spec`` False: a request the draft does not take (``ignore_eos``,
    which changes nothing here: the engine knows no end-of-sequence token)."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=not spec)
    return [t.token async for t in engine.generate(GenerationRequest("r", prompt, params))]


async def settled(engine: PipelineEngine) -> None:
    """Every entry the router named is kept or refused by every stage: the next turn may
    reuse it."""
    await until(lambda: engine.prompt_cache_stats()["pending"] == 0,
                "the stages' cache answers", timeout=20)


async def chat(engine: PipelineEngine, chat_id: int, spec: bool) -> list[list[int]]:
    """``TURNS`` turns, each the whole history (answers included) and a new user turn."""
    history: list[int] = []
    answers = []
    for turn in range(TURNS):
        history += [*user_turn(chat_id, turn), 3, 4]  # an end-of-turn, an assistant tag
        out = await tokens_of(engine, history, ANSWER, spec)
        await settled(engine)
        answers.append(out)
        history += [*out, 2]
    return answers


def run(mesh: MeshStages, work: Callable[[PipelineEngine], Awaitable[Any]],
        **knobs: Any) -> tuple[Any, dict[str, Any]]:
    """``work`` over a new engine (a new epoch: the stages drop earlier entries); its
    result and the router's prompt-cache counts."""
    async def go() -> tuple[Any, dict[str, Any]]:
        engine = mesh.engine(**knobs)
        try:
            return await work(engine), dict(engine.prompt_cache_stats())
        finally:
            await engine.aclose()

    return asyncio.run(go())


def cache_stats(mesh: MeshStages) -> dict[str, dict[str, int]]:
    """Each stage's rank 0's prompt-cache counts (its worker's stats, updated every
    ``STATS_EVERY_S``)."""
    time.sleep(1.5 * STATS_EVERY_S)
    return {key: mesh.stats(key)["prompt_cache"] for key in STAGES}


def mirrored(mesh: MeshStages, stats: dict[str, dict[str, int]]) -> None:
    """Each follower holds as many entries as its rank 0, of as many bytes (each rank's
    shard: half the heads)."""
    for key in STAGES:
        want = {"entries": stats[key]["entries"], "bytes": stats[key]["bytes"]}
        follower = key.replace("/stage", "/stage-tp-1")
        wait_for(lambda f=follower, w=want: mesh.stats(f)["tensor"]["prompt_cache"] == w,
                 10.0, f"{follower} to mirror {want}", every=0.3)


def gained(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]],
           key: str) -> list[int]:
    return [after[s][key] - before[s][key] for s in STAGES]


@pytest.mark.timeout(900)
def test_a_chat_on_a_2d_mesh_reuses_its_history_on_every_rank(
        pairs: Path, state_dir: Path) -> None:
    with mesh_stages(state_dir / "mesh", pairs / "plain", SPLITS, tensor={0, 1},
                     draft=pairs / "plain", k=3) as mesh:
        base, _ = run(mesh, lambda e: chat(e, 1, False), prompt_cache_bytes=0)
        base_kv, _ = run(mesh, lambda e: chat(e, 1, True), prompt_cache_bytes=0,
                         kv_quant=KV)
        counts = [cache_stats(mesh)]
        got = {}
        for name, spec, knobs in (("plain", False, {}), ("spec", True, {}),
                                  ("kv", True, {"kv_quant": KV})):
            passes = mesh.stats("1/stage")["speculative"]["passes"]
            got[name] = run(mesh, lambda e, s=spec: chat(e, 1, s), **knobs)
            counts.append(cache_stats(mesh))
            mirrored(mesh, counts[-1])
            got[name] += (mesh.stats("1/stage")["speculative"]["passes"] - passes,)
        logs = mesh.logs()
    for i, (name, (answers, router, passes)) in enumerate(got.items()):
        assert answers == (base_kv if name == "kv" else base), (name, logs)
        assert (router["hits"], router["misses"], router["lost"]) == (TURNS - 1, 1, 0), \
            (name, router)
        # every stage, rank 0 deciding for its ranks, started each later turn from the last
        assert gained(counts[i], counts[i + 1], "hits") == [TURNS - 1] * 2, (name, counts)
        # each turn from all of the last one but its answer's last token (never run): 32
        # tokens of a user turn, 6 answered and an end-of-turn
        reused = gained(counts[i], counts[i + 1], "tokens_reused")
        assert reused == [router["tokens_reused"]] * 2 == [
            sum(32 * k + 7 * (k - 1) + 5 for k in range(1, TURNS))] * 2, (name, reused)
        assert (passes > 0) == (name != "plain"), (name, passes)
    # the quantized cache is in play: kv's entries are a fraction of plain ones' bytes
    per_entry = [{s: c[s]["bytes"] / c[s]["entries"] for s in STAGES} for c in counts[1:]]
    assert all(per_entry[2][s] < per_entry[0][s] / 3 for s in STAGES), per_entry


@pytest.mark.timeout(900)
def test_evictions_under_a_small_bound_stay_mirrored(pairs: Path, state_dir: Path) -> None:
    """A bound of two or three entries: prompts, then the same again in reverse, evict
    on rank 0 and (by its journal) on its follower alike; what is reused after that
    still gives the tokens of a pipeline keeping nothing."""
    prompts = [user_turn(i, 0, 40) for i in range(5)]

    async def one(engine: PipelineEngine) -> list[int]:
        out = await tokens_of(engine, prompts[0], 4, False)
        await settled(engine)
        return out

    async def work(engine: PipelineEngine) -> list[list[int]]:
        outs = []
        for prompt in prompts + prompts[::-1]:
            outs.append(await tokens_of(engine, [*prompt, 7], 4, False))
            await settled(engine)
        return outs

    with mesh_stages(state_dir / "mesh", pairs / "plain", SPLITS, tensor={0, 1}) as mesh:
        want, _ = run(mesh, work, prompt_cache_bytes=0)
        run(mesh, one)  # one entry: its size
        size = max(s["bytes"] for s in cache_stats(mesh).values())
        before = cache_stats(mesh)
        outs, router = run(mesh, work, prompt_cache_bytes=2 * size + size // 2)
        after = cache_stats(mesh)
        mirrored(mesh, after)
        logs = mesh.logs()
    assert size > 0
    assert outs == want, logs
    assert min(gained(before, after, "evicted")) > 0, (before, after)
    assert all(after[s]["entries"] <= 2 for s in STAGES), after
    assert router["hits"] >= 1 and min(gained(before, after, "hits")) >= 1, (router, after)
