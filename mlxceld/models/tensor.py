"""Which models mlxceld splits by tensor parallelism, and the one check of it.

A tensor-parallel group of ``tp_size`` ranks on one host splits each layer's weights
with mlx-lm's own ``Model.shard(group)``: the attention heads, the KV heads and the
MLP's intermediate dimension are each cut into ``tp_size`` equal slices. So a model is
split only when its family's mlx-lm class has ``shard`` (``TENSOR_FAMILIES``) and
``tp_size`` divides each of those numbers.

``check_tensor_parallel(config, tp_size, source=...)`` judges config.json's contents;
``check_model_dir(path, tp_size)`` reads ``path/config.json`` first (nothing else: no
weight file is opened). Both raise ``TensorParallelRefused``, whose message names the
model (``source``), the reason (the family, or the key and its number) and what to do
(the supported families, or the tp sizes that would work). ``tp_size`` 1 always passes:
no group, nothing split. The daemon calls ``check_model_dir`` (``config/tensor.py``) at
start and on a reload for a local directory, and for a Hugging Face repo id once it has
fetched its config.json; and on `mlxctl serve`.

Importing this module does not import mlx: the daemon calls it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

# The most ranks one group may have (the flag's and the key's bound).
MAX_TP_SIZE: Final = 16

# The model_type values whose mlx-lm 0.32.2 class has ``shard``, with the names mlx-lm's
# MODEL_REMAPPING loads with one of those classes (mistral as llama, kimi_k2 as
# deepseek_v3, ...). tests/models/test_tensor_check.py holds it to mlx-lm itself.
TENSOR_FAMILIES: Final[frozenset[str]] = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v41", "deepseek_v41_text",
    "exaone_moe", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "iquestcoder",
    "iquestloopcoder", "joyai_llm_flash", "kimi_k2", "kimi_k25", "kimi_k3", "llama",
    "longcat_flash", "longcat_flash_ngram", "minimax", "minimax_m2", "minimax_m3_vl",
    "ministral3", "mistral", "mistral4", "muse_spark", "prism_hadamard_qwen35", "qwen2",
    "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "solar_open", "step3p5", "xverse"})

# The numbers shard() cuts into tp_size slices: (key, required). num_key_value_heads
# defaults to num_attention_heads (no GQA: checked with it); the MLP's sizes are checked
# where config.json has them.
_DIVIDED: Final = (
    ("num_attention_heads", True),
    ("num_key_value_heads", False),
    ("intermediate_size", False),
    ("moe_intermediate_size", False),
)


class TensorParallelRefused(ValueError):
    """The model cannot be split over ``tp_size`` ranks; the message names the model, the
    reason and what to do."""


def check_tensor_parallel(config: Mapping[str, Any], tp_size: int, *, source: str) -> None:
    """Refuse (``TensorParallelRefused``) to split the model whose config.json is ``config``
    (``source`` names it in the message: its path, its repo id) over ``tp_size`` ranks."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or not (
            1 <= tp_size <= MAX_TP_SIZE):
        raise TensorParallelRefused(
            f"{source}: tp_size must be a whole number from 1 to {MAX_TP_SIZE}, "
            f"not {tp_size!r}; give --tp-size (or [serve] tp_size) in that range")
    if tp_size == 1:
        return
    family = config.get("model_type")
    if not isinstance(family, str) or family not in TENSOR_FAMILIES:
        what = (f"model_type {family!r}" if isinstance(family, str)
                else "no 'model_type' (or one that is not a string)")
        raise TensorParallelRefused(
            f"{source} says {what}, a model family mlx-lm cannot split by tensor "
            f"parallelism (tp_size {tp_size}); it splits: {', '.join(sorted(TENSOR_FAMILIES))}."
            " Serve this model with tp_size 1, or use a checkpoint of one of those families")
    numbers = _divided_numbers(config, source)
    bad = [(key, n) for key, n in numbers if n % tp_size]
    if bad:
        key, n = bad[0]
        working = _working_sizes([n for _, n in numbers])
        raise TensorParallelRefused(
            f"{source}: tp_size {tp_size} does not divide {key} {n}: each of the "
            f"{tp_size} ranks would get a part of a head or a column "
            f"(the model has {_listed(numbers)}). tp sizes that split this model: "
            f"{', '.join(map(str, working))}; give one of them as --tp-size "
            "(or [serve] tp_size)")


def check_model_dir(path: Path, tp_size: int) -> None:
    """``check_tensor_parallel`` on ``path/config.json`` (``FileNotFoundError`` when there is
    none; ``TensorParallelRefused`` when it is not a JSON object)."""
    file = Path(path) / "config.json"
    if tp_size == 1:
        return
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise  # the caller's to word: a repo id not fetched yet is checked at load
    except OSError as exc:
        raise TensorParallelRefused(
            f"{file} cannot be read ({exc.strerror or exc}); check its permissions") from exc
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TensorParallelRefused(
            f"{file} is not valid JSON ({exc}); the checkpoint's config.json is damaged: "
            "download it again") from exc
    if not isinstance(config, dict):
        raise TensorParallelRefused(
            f"{file} holds a JSON {type(config).__name__}, not an object; the checkpoint's "
            "config.json is damaged: download it again")
    check_tensor_parallel(config, tp_size, source=str(file))


def _divided_numbers(config: Mapping[str, Any], source: str) -> list[tuple[str, int]]:
    """``(key, value)`` of each number shard() divides, read at the top of config.json or
    under ``text_config`` (multimodal checkpoints); the key is named as it was found."""
    text = config.get("text_config")
    tables = [("", config)] + ([("text_config.", text)] if isinstance(text, Mapping) else [])
    found: dict[str, tuple[str, int]] = {}
    for key, required in _DIVIDED:
        for where, table in tables:
            if key in table:
                value = table[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise TensorParallelRefused(
                        f"{source}: '{where}{key}' must be a positive integer, not "
                        f"{value!r}; the checkpoint's config.json is damaged: download it "
                        "again")
                found[key] = (where + key, value)
                break
        else:
            if required:
                raise TensorParallelRefused(
                    f"{source} has no '{key}' (nor 'text_config.{key}'), so whether the "
                    "model splits evenly over the ranks cannot be told; is this a "
                    "decoder-only LLM checkpoint? Serve it with tp_size 1")
    return list(found.values())


def _working_sizes(numbers: list[int]) -> list[int]:
    """The tp sizes up to MAX_TP_SIZE that divide every one of ``numbers``."""
    common = math.gcd(*numbers)
    return [n for n in range(1, MAX_TP_SIZE + 1) if common % n == 0]


def _listed(numbers: list[tuple[str, int]]) -> str:
    return ", ".join(f"{key} {n}" for key, n in numbers)
