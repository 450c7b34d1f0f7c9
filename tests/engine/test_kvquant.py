"""A quantized KV cache (``[serve] kv_bits``, engine/kvquant.py) in the local engine, against
mlx-lm's own quantized runs on our fixtures.

With ``quantized_kv_start`` 0 our caches are quantized from the first token; mlx-lm's
``generate_step`` quantizes after each step, so its start 0 leaves the first prefill step
at full precision; handed ``QuantizedKVCache``s to begin with, it quantizes from the first
token too, and that is the run compared (engine/kvquant.py says why). With a start above 0
the reference is ``generate_step(..., kv_bits=, kv_group_size=, quantized_kv_start=)``
as it is. Both with the engine's prefill chunks (``prefill_step_size``).
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import (
    LRUPromptCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from mlxceld.engine import GenerationRequest, SamplingParams
from mlxceld.engine.handoff import DEFAULT_PREFILL_STEP, prefill
from mlxceld.engine.kvquant import QuantizingKVCache, quantizing_caches
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.errors import ConfigError
from mlxceld.models import preset, write_fixture
from mlxceld.roles.options import KVQuant

from helpers.models import quantized_greedy

N = 24
LONG = [3 + (i * 7) % 240 for i in range(600)]  # two prefill chunks (512 + 88)
PROMPTS = [[5, 6, 7], [(i * 37 + 11) % 500 + 1 for i in range(40)], LONG]


def mlx_lm_run(model: Any, prompt: list[int], n: int, kv: KVQuant | None, eos: set[int],
               cache: list[Any] | None = None) -> tuple[list[int], list[float]]:
    return quantized_greedy(model, prompt, n, kv, eos, cache, prefill_step=DEFAULT_PREFILL_STEP)


def mlx_lm_tokens(model: Any, prompt: list[int], n: int, kv: KVQuant | None,
                  eos: set[int], cache: list[Any] | None = None) -> list[int]:
    return mlx_lm_run(model, prompt, n, kv, eos, cache)[0]


async def engine_tokens(engine: LocalEngine, prompt: list[int], n: int) -> list[int]:
    req = GenerationRequest("t", prompt, SamplingParams(max_tokens=n, temperature=0))
    return [t.token async for t in engine.generate(req)]


async def engine_logprobs(engine: LocalEngine, prompt: list[int], n: int) -> list[float]:
    req = GenerationRequest("t", prompt, SamplingParams(max_tokens=n, temperature=0,
                                                        logprobs=0))
    return [t.logprob async for t in engine.generate(req) if t.logprob is not None]


def alone_and_together(path: Path, kv: KVQuant, prompts: list[list[int]]
                       ) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Each prompt's tokens alone, then all at once (a cold engine), and the first prompt's
    log-probabilities."""
    async def run() -> tuple[list[list[int]], list[list[int]], list[float]]:
        alone_engine, _ = load_local_engine(str(path), max_batch=4, kv_quant=kv)
        engine, _ = load_local_engine(str(path), max_batch=4, kv_quant=kv)  # a cold cache
        try:
            alone = [await engine_tokens(alone_engine, p, N) for p in prompts]
            together = list(await asyncio.gather(*(engine_tokens(engine, p, N)
                                                   for p in prompts)))
            return alone, together, await engine_logprobs(engine, prompts[0], N)
        finally:
            await alone_engine.aclose()
            await engine.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize(("family", "bits"), [("llama", 8), ("qwen3", 4)])
def test_greedy_tokens_are_mlx_lm_quantized_alone_and_batched(kv_fixture_dir: Path,
                                                              family: str, bits: int) -> None:
    path = kv_fixture_dir / family
    kv = KVQuant(bits, 64, 0)
    model, tokenizer = load(str(path))
    eos = set(tokenizer.eos_token_ids)
    alone, together, logprobs = alone_and_together(path, kv, PROMPTS)
    assert together == alone  # batching (padding, merging, splitting) changes nothing
    for prompt, got in zip(PROMPTS, alone, strict=True):
        assert got == mlx_lm_tokens(model, prompt, N, kv, eos), len(prompt)
    # and the cache is quantized indeed: its log-probabilities are the quantized run's,
    # and full precision's differ
    _, quantized = mlx_lm_run(model, PROMPTS[0], N, kv, eos)
    _, full = mlx_lm_run(model, PROMPTS[0], N, None, eos)
    assert max(abs(a - b) for a, b in zip(logprobs, quantized, strict=True)) < 1e-5
    assert abs(logprobs[0] - full[0]) > 1e-4  # the first token's, after the same prompt


def test_a_later_start_quantizes_at_mlx_lms_step(kv_fixture_dir: Path) -> None:
    """``quantized_kv_start`` 20: crossed while decoding (a 3-token prompt), in the last
    prompt step (39 tokens in the first, the 40th alone) and in the first prefill chunk:
    mlx-lm's ``generate_step`` with the same start, token for token."""
    path = kv_fixture_dir / "llama"
    kv = KVQuant(8, 64, 20)
    model, tokenizer = load(str(path))
    eos = set(tokenizer.eos_token_ids)

    async def run() -> list[list[int]]:
        engine, _ = load_local_engine(str(path), max_batch=4, kv_quant=kv)
        try:
            return [await engine_tokens(engine, p, N) for p in PROMPTS]
        finally:
            await engine.aclose()

    for prompt, got in zip(PROMPTS, asyncio.run(run()), strict=True):
        assert got == mlx_lm_tokens(model, prompt, N, kv, eos), len(prompt)


def test_a_prefix_from_the_prompt_cache_gives_mlx_lms_next_turn(kv_fixture_dir: Path) -> None:
    """A chat's second turn reuses the first turn's quantized cache (mlx-lm's
    ``LRUPromptCache``: deep-copied, its nearest prefix found): its tokens are mlx-lm's
    second turn over its own first turn's cache (every token it yielded is in both), as
    mlx_lm.server reuses it; an exact repeat trims one token and gives the first turn's
    tokens again."""
    path = kv_fixture_dir / "qwen3"
    kv = KVQuant(8, 64, 0)
    model, tokenizer = load(str(path))
    eos = set(tokenizer.eos_token_ids)
    first = [(i * 13 + 5) % 400 + 1 for i in range(30)]
    later = [7, 8, 9, 10, 11]

    async def run() -> tuple[list[int], list[int], list[int], int]:
        engine, _ = load_local_engine(str(path), max_batch=2, kv_quant=kv)
        try:
            one = await engine_tokens(engine, first, N)
            second = first + one + later
            cache, rest = engine._prompt_cache.fetch(second)
            assert cache is not None and all(isinstance(c, QuantizingKVCache) and c.quantized
                                             for c in cache)
            two = await engine_tokens(engine, second, N)
            again = await engine_tokens(engine, first, N)
            return one, two, again, len(rest)
        finally:
            await engine.aclose()

    one, two, again, rest = asyncio.run(run())
    assert rest == len(later)  # every token the first turn yielded was fed: it is cached
    cache = [QuantizedKVCache(kv.group_size, kv.bits) for _ in model.layers]
    assert one == mlx_lm_tokens(model, first, N, kv, eos, cache)
    assert again == one
    assert cache[0].offset == len(first) + len(one)  # mlx-lm's holds the same tokens
    assert two == mlx_lm_tokens(model, later, N, kv, eos, cache)


def test_a_quantizing_cache_is_what_mlx_lm_prompt_caches_take(kv_fixture_dir: Path) -> None:
    """Trimmed (``can_trim_prompt_cache``, ``trim_prompt_cache``), deep-copied and counted
    by mlx-lm's ``LRUPromptCache`` like its own caches; quantized at ``start`` tokens."""
    model, _ = load(str(kv_fixture_dir / "llama"))
    cache = quantizing_caches(model, KVQuant(8, 64, 8))
    model(mx.array([list(range(1, 7))]), cache=cache)  # 6 tokens: still full precision
    assert not cache[0].quantized and not hasattr(cache[0], "bits")
    full = cache[0].nbytes
    model(mx.array([[7, 8, 9]]), cache=cache)  # not yet: the step began at 6
    model(mx.array([[10]]), cache=cache)  # began at 9 >= 8: quantized, then stored
    assert cache[0].quantized and cache[0].bits == 8 and cache[0].offset == 10
    assert can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 3) == 3
    assert cache[0].offset == 7
    lru = LRUPromptCache(4)
    lru.insert_cache("m", list(range(1, 8)), cache)
    assert lru.nbytes == sum(c.nbytes for c in cache) > 0
    assert cache[0].nbytes < full  # 256 rows of 8 bits and scales, against 256 of 32
    got, rest = lru.fetch_nearest_cache("m", list(range(1, 8)))
    assert rest == [] and got is not cache and got[0].offset == 7
    twin = copy.deepcopy(cache)
    a = model(mx.array([[11]]), cache=cache)
    b = model(mx.array([[11]]), cache=twin)
    assert mx.array_equal(a, b)


def test_a_decode_node_quantizes_a_handed_off_cache_from_its_next_step(
        kv_fixture_dir: Path) -> None:
    """A prompt prefilled at full precision elsewhere (``handoff.prefill``) joins the batch
    quantized from its first decode step: mlx-lm's run over that cache made a
    ``QuantizedKVCache`` (``to_quantized``) first."""
    path = kv_fixture_dir / "llama"
    kv = KVQuant(4, 64, 0)
    model, tokenizer = load(str(path))
    eos = set(tokenizer.eos_token_ids)
    prompt = PROMPTS[1]
    req = GenerationRequest("h", prompt, SamplingParams(max_tokens=N, temperature=0))

    def prefilled() -> tuple[Any, list[Any]]:
        return prefill(model, prompt, req.params, vocab_size=model.args.vocab_size,
                       eos_token_ids=eos)

    async def run() -> list[int]:
        engine, _ = load_local_engine(str(path), max_batch=2, kv_quant=kv)
        try:
            first, cache = prefilled()
            return [t.token async for t in engine.generate_from(req, first, cache)]
        finally:
            await engine.aclose()

    got = asyncio.run(run())
    first, cache = prefilled()
    quantized = [c.to_quantized(group_size=kv.group_size, bits=kv.bits) for c in cache]
    assert got == [first.token, *mlx_lm_tokens(model, [first.token], N - 1, kv, eos,
                                               quantized)]


def test_a_model_that_cannot_keep_a_quantized_cache_is_refused_by_name(
        tmp_path: Path) -> None:
    """The loaded model is judged too (before its weights are read): gemma3's
    sliding-window layers, deepseek_v3's latent attention, heads the group does not
    divide."""
    for family, knobs in (("gemma3_text", {"head_dim": 64}), ("deepseek_v3", {}),
                          ("llama", {})):
        path = tmp_path / family
        write_fixture(path, preset("tiny", family=family, **knobs))
        with pytest.raises(ConfigError) as err:
            load_local_engine(str(path), kv_quant=KVQuant(8))
        assert err.value.message.startswith(f"serve.kv_bits = 8: {path / 'config.json'}: ")
        if family == "llama":  # 16-element heads
            assert "kv_group_size 64 does not divide" in err.value.message
            assert "kv_group_size" in (err.value.hint or "")
        else:
            assert f"model family {family!r} cannot keep a quantized KV cache" \
                in err.value.message
            assert "kv_bits" in (err.value.hint or "")
