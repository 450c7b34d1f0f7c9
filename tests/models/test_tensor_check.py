"""The tensor-parallel check (``models.tensor``): which families, which sizes, what it says."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import mlx_lm.models
import pytest
from mlx_lm.utils import MODEL_REMAPPING

from mlxceld.models import model_config, preset
from mlxceld.models.tensor import (
    MAX_TP_SIZE,
    TENSOR_FAMILIES,
    TensorParallelRefused,
    check_model_dir,
    check_tensor_parallel,
)

LLAMA = {"model_type": "llama", "num_attention_heads": 12, "num_key_value_heads": 4,
         "intermediate_size": 96}


def mlx_lm_shard_families() -> frozenset[str]:
    """The model types whose mlx-lm class has ``shard``, asked of mlx-lm itself: each of
    its model modules imported, and the names it remaps to one of them."""
    found = set()
    for module in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            loaded = importlib.import_module(f"mlx_lm.models.{module.name}")
        except (ImportError, SystemExit):  # olmo exits when ai2-olmo is not installed
            continue
        if hasattr(getattr(loaded, "Model", None), "shard"):
            found.add(module.name)
    return frozenset(found | {alias for alias, to in MODEL_REMAPPING.items() if to in found})


def test_the_families_are_mlx_lms(capsys: pytest.CaptureFixture[str]) -> None:
    assert mlx_lm_shard_families() == TENSOR_FAMILIES
    capsys.readouterr()  # what a module printed on its failed import
    assert {"llama", "mistral", "qwen3", "qwen2"} <= TENSOR_FAMILIES


def test_importing_the_check_imports_no_mlx() -> None:
    code = ("import sys, mlxceld.models.tensor; "
            "sys.exit(any(m == 'mlx' or m.startswith('mlx.') or m.startswith('mlx_lm') "
            "for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_tiny_fixtures_split_in_two(tmp_path: Path, family: str) -> None:
    config = model_config(preset("tiny", family=family), [1])
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_model_dir(tmp_path, 2)
    check_tensor_parallel(config, 1, source="m")


def test_a_family_without_shard_is_refused_naming_it_and_the_supported_ones(
        tmp_path: Path) -> None:
    config = model_config(preset("tiny", family="gemma3"), [1])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TensorParallelRefused) as info:
        check_model_dir(tmp_path, 2)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'config.json'} says model_type 'gemma3'")
    assert all(family in message for family in TENSOR_FAMILIES)
    assert "tp_size 1" in message
    check_model_dir(tmp_path, 1)  # whole: nothing to split


def test_no_model_type_is_refused() -> None:
    with pytest.raises(TensorParallelRefused, match="no 'model_type'"):
        check_tensor_parallel({"num_attention_heads": 4}, 2, source="m")


@pytest.mark.parametrize(("config", "tp", "named", "working"), [
    (LLAMA, 8, "num_attention_heads 12", "1, 2, 4"),
    (LLAMA, 3, "num_key_value_heads 4", "1, 2, 4"),
    ({**LLAMA, "intermediate_size": 90}, 4, "intermediate_size 90", "1, 2"),
    ({**LLAMA, "num_key_value_heads": 1}, 2, "num_key_value_heads 1", "1"),
    ({"model_type": "qwen3_moe", "num_attention_heads": 16, "num_key_value_heads": 16,
      "intermediate_size": 64, "moe_intermediate_size": 24}, 16, "moe_intermediate_size 24",
     "1, 2, 4, 8"),
    ({"model_type": "mistral", "num_attention_heads": 6}, 4, "num_attention_heads 6", "1, 2, 3, 6"),
    ({"model_type": "qwen3_5", "text_config": {"num_attention_heads": 8,
                                               "num_key_value_heads": 2}},
     4, "text_config.num_key_value_heads 2", "1, 2"),
])
def test_a_size_that_does_not_divide_is_refused_naming_key_number_and_sizes_that_work(
        config: dict[str, object], tp: int, named: str, working: str) -> None:
    with pytest.raises(TensorParallelRefused) as info:
        check_tensor_parallel(config, tp, source="/models/m")
    message = str(info.value)
    assert message.startswith(f"/models/m: tp_size {tp} does not divide {named}:"), message
    assert f"tp sizes that split this model: {working};" in message
    assert "--tp-size" in message


def test_kv_heads_default_to_heads() -> None:
    config = {"model_type": "llama", "num_attention_heads": 6}
    check_tensor_parallel(config, 2, source="m")
    check_tensor_parallel(config, 6, source="m")


@pytest.mark.parametrize("tp", [0, -1, MAX_TP_SIZE + 1, True, 2.0])
def test_a_size_out_of_bounds_is_refused(tp: int) -> None:
    with pytest.raises(TensorParallelRefused, match=f"from 1 to {MAX_TP_SIZE}"):
        check_tensor_parallel(LLAMA, tp, source="m")


@pytest.mark.parametrize(("config", "named"), [
    ({"model_type": "llama"}, "has no 'num_attention_heads'"),
    ({**LLAMA, "num_key_value_heads": "4"}, "'num_key_value_heads' must be a positive"),
    ({**LLAMA, "intermediate_size": 0}, "'intermediate_size' must be a positive"),
])
def test_a_config_that_cannot_be_judged_is_refused_naming_the_key(
        config: dict[str, object], named: str) -> None:
    with pytest.raises(TensorParallelRefused, match=named):
        check_tensor_parallel(config, 2, source="m")


def test_a_directory_without_config_json_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        check_model_dir(tmp_path, 2)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_damaged_config_json_is_refused_naming_the_file(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(TensorParallelRefused, match=r"config\.json is damaged") as info:
        check_model_dir(tmp_path, 2)
    assert str(tmp_path / "config.json") in str(info.value)
