"""The safetensors index of a sharded checkpoint, and which of its shards a stage reads.

A sharded mlx-lm (or Hugging Face) checkpoint names every tensor's file in
``model.safetensors.index.json``: ``{"metadata": {"total_size": N, ...},
"weight_map": {tensor name: file name}}``. Every host holds the index (it is
part of the model identity, ``identity.py``); a host that runs a stage needs
only the shards that hold what the stage keeps (``stage_files``), the way
``slicing.StageModel`` prunes a model:

- a tensor of decoder layer ``i`` (a name with ``layers.{i}.``, as mlx-lm's own
  ``sharded_load`` matches them): stages whose range holds ``i``; layers past
  the model's last (multi-token-prediction layers, which mlx-lm's sanitize
  drops) on none;
- the embeddings (``embed_tokens``): the first stage, and the last when the
  head is tied to them;
- the final norm (``model.norm``) and the head (``lm_head``): the last stage;
- anything else: every stage (``StageModel`` keeps it).

A checkpoint without an index is one file, which every stage reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import ConfigError

INDEX: Final = "model.safetensors.index.json"
DAMAGED: Final = "the checkpoint is damaged or incomplete; download it again"
_LAYER: Final = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightIndex:
    """``model.safetensors.index.json``: each tensor's file, and the total size it states."""

    weight_map: Mapping[str, str]
    total_size: int  # metadata.total_size; 0 when the index states none

    @property
    def files(self) -> frozenset[str]:
        return frozenset(self.weight_map.values())


def read_index(path: Path) -> WeightIndex | None:
    """The index of the model directory ``path``; None when it has none (one file)."""
    file = Path(path) / INDEX
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{file} cannot be read: {exc.strerror or exc}",
                          hint="check its permissions") from exc
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file} is not valid JSON: {exc}", hint=DAMAGED) from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{file} has no 'weight_map' object naming each tensor's file",
                          hint=DAMAGED)
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or "/" in shard or shard.startswith("."):
            raise ConfigError(f"{file}: tensor {name!r} maps to {shard!r}, not a file name "
                              "in the model directory", hint=DAMAGED)
    metadata = data.get("metadata")
    total = metadata.get("total_size", 0) if isinstance(metadata, dict) else 0
    if isinstance(total, bool) or not isinstance(total, int | float) or total < 0:
        raise ConfigError(f"{file}: metadata.total_size is {total!r}, not a byte count",
                          hint=DAMAGED)
    return WeightIndex(dict(weight_map), int(total))


def stage_files(index: WeightIndex, config: Mapping[str, Any], start: int, end: int,
                num_layers: int) -> frozenset[str]:
    """The shards that hold what the stage of layers [start, end) keeps (module docstring)."""
    first, last = start == 0, end == num_layers
    tied = _tied(config, index)
    files: set[str] = set()
    for name, file in index.weight_map.items():
        m = _LAYER.search(name)
        if m is not None:
            keep = start <= int(m.group(1)) < end
        elif "embed_tokens." in name:
            keep = first or (last and tied)
        elif name.startswith(("model.norm.", "lm_head.")):
            keep = last
        else:
            keep = True
        if keep:
            files.add(file)
    return frozenset(files)


def missing_files(path: Path, files: frozenset[str]) -> list[str]:
    """Those of ``files`` that the directory ``path`` does not hold, sorted."""
    return sorted(f for f in files if not (Path(path) / f).is_file())


def _tied(config: Mapping[str, Any], index: WeightIndex) -> bool:
    """Tied as config.json says (mlx-lm builds the model from it); without the key, tied
    when the index names no head."""
    for table in (config, config.get("text_config")):
        if isinstance(table, Mapping) and "tie_word_embeddings" in table:
            return bool(table["tie_word_embeddings"])
    return "lm_head.weight" not in index.weight_map
