"""Models for the tests: tiny checkpoints from our fixture generator, and what mlx-lm itself
generates from one (the text a daemon must serve)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from mlxceld.models import preset, write_fixture
from mlxceld.roles.options import KVQuant

FAMILIES = ("llama", "qwen3")
SMALL_CONTEXT = 600  # conftest's small_context: a model whose context ends quickly
PROMPT = "The quick brown fox"


def write_tiny_checkpoints(root: Path, **changes: Any) -> Path:
    """The ``tiny`` preset of each family under ``root`` (``root/llama``, ``root/qwen3``),
    with ``changes`` to the preset (``layers=4``)."""
    for family in FAMILIES:
        write_fixture(root / family, preset("tiny", family=family, **changes))
    return root


def eos_ids(model: Path) -> list[int]:
    """The model's end-of-sequence token ids, as its config and generation config name them
    (an int or a list in either)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        ids |= set(value if isinstance(value, list) else [] if value is None else [value])
    return sorted(ids)


def expected(model: Path, prompt: str, n: int) -> str:
    """mlx-lm's greedy text for ``prompt``, ``n`` tokens at most."""
    m, tok = mlx_lm.load(str(model))
    text: str = mlx_lm.generate(m, tok, prompt, max_tokens=n)
    return text


def greedy_reference(model: Path, prompt: str, n: int) -> tuple[list[int], list[int], list[Any]]:
    """The prompt's token ids, then mlx-lm's greedy tokens and log-probabilities for ``n``
    steps on the whole model, loaded with plain ``mlx_lm.load``."""
    m, tok = mlx_lm.load(str(model))[:2]
    ids: list[int] = tok.encode(prompt)
    steps = list(generate_step(mx.array(ids), m, max_tokens=n))
    return ids, [int(t) for t, _ in steps], [lp for _, lp in steps]


def chained_greedy(stages: list[Any], prompt: list[int], n: int) -> tuple[list[int], list[Any]]:
    """``prompt`` through ``stages`` (``StageModel``s of consecutive layers, chained in this
    process, one cache each), then ``n`` greedy steps: the tokens and log-probabilities."""
    caches = [stage.make_cache() for stage in stages]
    x = mx.array([prompt], dtype=mx.int32)
    tokens, logprobs = [], []
    for _ in range(n):
        h = x
        for stage, cache in zip(stages, caches, strict=True):
            h = stage.forward(h, cache)
        token = int(mx.argmax(h, axis=-1).item())
        tokens.append(token)
        logprobs.append(h[0])
        x = mx.array([[token]], dtype=mx.int32)
    return tokens, logprobs


def quantized_greedy(model: Any, prompt: list[int], n: int, kv: KVQuant | None,
                     eos: set[int], cache: list[Any] | None = None, *,
                     prefill_step: int = 512) -> tuple[list[int], list[float]]:
    """mlx-lm's own greedy run with a quantized KV cache (``kv``; None: full precision):
    ``generate_step`` with the same ``kv_bits``, ``kv_group_size`` and
    ``quantized_kv_start``, prefilling in ``prefill_step`` chunks (the engines' 512), until
    ``n`` tokens or one of ``eos``; the tokens and each one's log-probability. With start 0
    it is handed ``QuantizedKVCache``s to begin with: mlx-lm quantizes only after a step,
    so its own start 0 leaves the first prefill step at full precision, where ours
    quantizes from the first token (``mlxceld/engine/kvquant.py``). ``cache``: its prompt
    cache, filled in place (a later turn goes on from it)."""
    if cache is None:
        cache = ([QuantizedKVCache(kv.group_size, kv.bits) for _ in model.layers]
                 if kv is not None and kv.start == 0 else make_prompt_cache(model))
    knobs: dict[str, Any] = {} if kv is None else {
        "kv_bits": kv.bits, "kv_group_size": kv.group_size, "quantized_kv_start": kv.start}
    tokens: list[int] = []
    logprobs: list[float] = []
    for token, lp in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                                   prefill_step_size=prefill_step, **knobs):
        tokens.append(int(token))
        logprobs.append(float(lp[int(token)]))
        if int(token) in eos:
            break
    return tokens, logprobs
