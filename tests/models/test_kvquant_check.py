"""Which families keep a quantized KV cache: ``models/kvquant.py``'s table (from config.json,
no mlx) held to mlx-lm itself (``engine/kvquant.py``'s ``kv_refusal`` on the loaded model:
each layer's cache kind, and a forward over quantized caches, built and never run), for
every family our fixture generator writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from mlxceld.engine.kvquant import kv_refusal
from mlxceld.models import model_config, preset, write_fixture
from mlxceld.models.families import SUPPORTED
from mlxceld.models.fixtures.families import TRAITS
from mlxceld.models.kvquant import KV_REFUSED, kv_problem
from mlxceld.roles.options import KVQuant

KV = KVQuant(8, 64)


@pytest.mark.parametrize("family", sorted(TRAITS))
def test_the_table_says_what_mlx_lm_does(family: str, tmp_path: Path) -> None:
    """Every family the generator writes (and so every one a pipeline splits), its heads of
    64 elements: refused from config.json exactly where mlx-lm cannot take the cache."""
    spec = preset("tiny", family=family, hidden=256, heads=4, kv_heads=2)
    path = write_fixture(tmp_path / family, spec)
    model, _ = load(str(path), lazy=True)
    why = kv_refusal(model, KV)
    problem = kv_problem(model_config(spec, [1]), KV)
    assert (problem is None) == (why is None), (family, problem, why)
    assert (family in KV_REFUSED) == (why is not None)


def test_llama_with_window_layers_is_refused_and_the_table_covers_the_split_families(
        tmp_path: Path) -> None:
    spec = preset("tiny", family="llama", hidden=256, heads=4, kv_heads=2)
    config: dict[str, Any] = {**model_config(spec, [1]), "sliding_window": 16,
                              "layer_types": ["sliding_attention", "full_attention"]}
    assert "layer_types has sliding-window layers" in (kv_problem(config, KV) or "")
    path = write_fixture(tmp_path / "llama", spec)
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load(str(path), lazy=True)
    assert "RotatingKVCache" in (kv_refusal(model, KV) or "")
    assert set(KV_REFUSED) <= set(SUPPORTED)  # the table's names are the split families'
    assert kv_problem({"model_type": "kimi_k2"}, KV) is not None  # loaded as deepseek_v3
    assert kv_problem({"model_type": "qwen3", "head_dim": 96}, KV) is not None
    assert kv_problem({"model_type": "qwen3", "head_dim": 96}, KVQuant(8, 32)) is None
