"""The local engine against mlx-lm itself, on our tiny fixtures (its load reports progress)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, load
from mlx_lm.generate import generate_step

from mlxceld.engine import EngineError, GenerationRequest, SamplingParams
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine

from helpers.waiting import until

PROMPTS = ["Hello, world", "The quick brown fox jumps over", "x"]


def reference_tokens(model: Any, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(token))
        if int(token) in eos:
            break
    return out


async def engine_tokens(engine: LocalEngine, prompt: list[int], n: int,
                        **params: Any) -> list[int]:
    req = GenerationRequest("t", prompt, SamplingParams(max_tokens=n, **params))
    return [t.token async for t in engine.generate(req)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_equal_mlx_lm(fixture_dir: Path, family: str) -> None:
    path = str(fixture_dir / family)
    model, tokenizer = load(path)
    eos = set(tokenizer.eos_token_ids)
    reports: list[tuple[int, int]] = []

    async def run() -> list[list[int]]:
        engine, _ = load_local_engine(path, max_batch=4,
                                      progress=lambda done, total: reports.append((done, total)))
        try:
            prompts = [tokenizer.encode(p) for p in PROMPTS]
            alone = [await engine_tokens(engine, p, 40, temperature=0) for p in prompts]
            together = await asyncio.gather(*(engine_tokens(engine, p, 40, temperature=0)
                                              for p in prompts))
            assert list(together) == alone  # batching does not change greedy output
            return alone
        finally:
            await engine.aclose()

    got = asyncio.run(run())
    # Its weights were read layer by layer (then the rest), each step reported in bytes.
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert reports[0] == (0, total) and reports[-1] == (total, total)
    assert len(reports) == len(model.layers) + 2
    assert [d for d, _ in reports] == sorted(d for d, _ in reports)
    assert 0 < reports[1][0] < total
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ref = reference_tokens(model, tokenizer.encode(prompt), 40, eos)
        assert tokens == ref, prompt
        assert len(set(tokens)) > 1  # a non-degenerate fixture
    # and the text mlx_lm.generate prints is those tokens through mlx-lm's detokenizer
    text = generate(model, tokenizer, PROMPTS[1], max_tokens=40)
    detok = tokenizer.detokenizer
    detok.reset()
    for t in got[1]:
        if t not in eos:
            detok.add_token(t)
    detok.finalize()
    assert text == detok.text


def test_seeded_sampling_is_reproducible_and_cancellation_frees(fixture_dir: Path) -> None:
    async def run() -> None:
        engine, tokenizer = load_local_engine(str(fixture_dir / "llama"), max_batch=4)
        try:
            prompt = tokenizer.encode("Once upon a time")
            a = await engine_tokens(engine, prompt, 20, temperature=1.0, seed=7)
            b, _noise = await asyncio.gather(
                engine_tokens(engine, prompt, 20, temperature=1.0, seed=7),
                engine_tokens(engine, prompt, 20, temperature=1.0, seed=99))
            assert a == b  # same seed, same tokens, whatever shares the batch
            # a penalized sequence's processors are its own: the same tokens in a batch
            c = await engine_tokens(engine, prompt, 20, temperature=0, frequency_penalty=1.5,
                                    logit_bias=((5, 2.0),))
            d, _plain = await asyncio.gather(
                engine_tokens(engine, prompt, 20, temperature=0, frequency_penalty=1.5,
                              logit_bias=((5, 2.0),)),
                engine_tokens(engine, prompt, 20, temperature=0))
            assert c == d != _plain
            # a parameter the engine cannot take fails its request, not the engine
            for bad in ({"temperature": 1.0, "seed": -1}, {"logit_bias": ((10**6, 1.0),)}):
                with pytest.raises(EngineError):
                    await engine_tokens(engine, prompt, 4, **bad)
            assert len(await engine_tokens(engine, prompt, 4, temperature=0)) == 4
            stream = engine.generate(GenerationRequest(
                "c", prompt, SamplingParams(max_tokens=10_000, temperature=0.8)))
            async for _ in stream:
                break
            await stream.aclose()
            assert engine.active_sequences() == 0
            await until(lambda: not engine._by_uid,  # the step thread drops it soon after
                        "the sequence to be dropped", timeout=1.0)
        finally:
            await engine.aclose()

    asyncio.run(run())


def test_prompt_cache_reuses_a_prefix_without_changing_tokens(fixture_dir: Path) -> None:
    async def run() -> None:
        engine, tokenizer = load_local_engine(str(fixture_dir / "qwen3"), max_batch=2)
        try:
            base = tokenizer.encode("A long shared system prompt, then a question")
            prompt = base + tokenizer.encode(" one")
            cold = await engine_tokens(engine, prompt, 16, temperature=0)
            stats = engine.prompt_cache_stats()  # the finished sequence's KV cache is kept
            assert (stats["hits"], stats["misses"], stats["tokens_reused"],
                    stats["entries"]) == (0, 1, 0, 1)
            assert stats["bytes"] > 0
            warm = await engine_tokens(engine, prompt, 16, temperature=0)
            assert warm == cold
            stats = engine.prompt_cache_stats()  # everything but the last token was reused
            assert (stats["hits"], stats["misses"], stats["tokens_reused"]) == (
                1, 1, len(prompt) - 1)
            assert stats["entries"] == 1 and stats["bytes"] > 0
        finally:
            await engine.aclose()

    asyncio.run(run())


def test_a_prompt_cache_of_zero_bytes_keeps_nothing(fixture_dir: Path) -> None:
    async def run() -> None:
        engine, tokenizer = load_local_engine(str(fixture_dir / "qwen3"), max_batch=2,
                                              prompt_cache_bytes=0)
        try:
            prompt = tokenizer.encode("A long shared system prompt, then a question")
            first = await engine_tokens(engine, prompt, 8, temperature=0)
            assert await engine_tokens(engine, prompt, 8, temperature=0) == first
            assert engine.prompt_cache_stats() == {"hits": 0, "misses": 2, "tokens_reused": 0,
                                                   "entries": 0, "bytes": 0}
        finally:
            await engine.aclose()

    asyncio.run(run())
