"""models/tensor_modes.py held to mlx-lm's own ``shard`` methods: which families cut the
head, that none cuts the embedding, and what each model's head gets."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest
from mlx_lm.utils import MODEL_REMAPPING

from mlxceld.models.tensor import TENSOR_FAMILIES, TensorParallelRefused
from mlxceld.models.tensor_modes import (
    HEAD_SHARDED_ALWAYS,
    HEAD_SHARDED_UNTIED,
    Mode,
    Part,
    TensorModes,
    check_modes,
    head_mode,
)

NAMES: dict[Part, str] = {"moe": "--tp-moe-mode", "embedding": "--tp-embedding-mode",
                          "lm_head": "--tp-lm-head-mode"}


def shard_source(family: str) -> str:
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}")
    return inspect.getsource(module.Model.shard)  # inherited where the class has none


def test_the_families_that_cut_the_head_are_mlx_lms() -> None:
    cutting = {f for f in TENSOR_FAMILIES if "lm_head = shard_linear" in shard_source(f)}
    assert cutting == HEAD_SHARDED_UNTIED | HEAD_SHARDED_ALWAYS
    tied_rule = {f for f in cutting if "tie_word_embeddings" in shard_source(f)}
    assert tied_rule == HEAD_SHARDED_UNTIED


def test_no_family_cuts_the_embedding() -> None:
    assert not [f for f in TENSOR_FAMILIES if "embed_tokens = shard" in shard_source(f)]


@pytest.mark.parametrize(("config", "mode"), [
    ({"model_type": "llama"}, "replicate"),
    ({"model_type": "qwen3_moe"}, "replicate"),
    ({"model_type": "muse_spark", "tie_word_embeddings": True}, "shard"),
    ({"model_type": "qwen3_5"}, "shard"),  # mlx-lm's default: untied
    ({"model_type": "qwen3_5_moe", "text_config": {"tie_word_embeddings": True}}, "replicate"),
    ({"model_type": "qwen3_5", "tie_word_embeddings": True}, "replicate"),
])
def test_each_models_head(config: dict[str, object], mode: Mode) -> None:
    assert head_mode(config) == mode
    check_modes(config, TensorModes(lm_head=mode), source="m", names=NAMES)
    other: Mode = "shard" if mode == "replicate" else "replicate"
    with pytest.raises(TensorParallelRefused, match=f"^m: --tp-lm-head-mode {other}: "):
        check_modes(config, TensorModes(lm_head=other), source="m", names=NAMES)


def test_the_fixed_parts_are_judged_whatever_the_model() -> None:
    check_modes({"model_type": "llama"}, TensorModes("shard", "replicate"), source="m",
                names=NAMES)
    with pytest.raises(TensorParallelRefused, match=r"--tp-moe-mode replicate: .* experts"):
        check_modes({"model_type": "llama"}, TensorModes(moe="replicate"), source="m",
                    names=NAMES)
    with pytest.raises(TensorParallelRefused, match=r"--tp-embedding-mode shard: .*embedding"):
        check_modes({"model_type": "llama"}, TensorModes(embedding="shard"), source="m",
                    names=NAMES)


def test_importing_it_imports_no_mlx() -> None:
    code = ("import sys, mlxceld.models.tensor_modes, mlxceld.config.tensor_modes; "
            "sys.exit(any(m == 'mlx' or m.startswith('mlx.') or m.startswith('mlx_lm') "
            "for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
