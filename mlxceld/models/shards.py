"""The safetensors index of a sharded checkpoint, and which of its shards a stage reads.

A sharded mlx-lm (or Hugging Face) checkpoint names every tensor's file in
``model.safetensors.index.json``: ``{"metadata": {"total_size": N, ...},
"weight_map": {tensor name: file name}}``. Every host holds the index (it is
part of the model identity, ``identity.py``); a host that runs a stage needs
only the shards that hold what the stage keeps (``stage_files``), the way
``slicing.StageModel`` prunes a model.

Where a tensor goes is one function, ``tensor_part``, which the cost profile
(``profile.py``) prices by and ``stage_files`` fetches and loads by:

- in a multimodal checkpoint (gemma3), ``language_model.*`` is read without that
  prefix, and the vision tower (``vision_tower.*``, ``multi_modal_projector.*``)
  belongs to no stage (mlx-lm's sanitize drops it);
- ``model.layers.{i}.*``: decoder layer ``i``, on the stage whose range holds
  it; the ``num_nextn_predict_layers`` layers past the last (multi-token
  prediction, in deepseek_v3 and glm4_moe checkpoints as published) on none,
  as mlx-lm's sanitize drops them;
- ``model.embed_tokens.*``: the first stage, and the last when the head is
  tied to them;
- ``model.norm.*``: the last stage; ``lm_head.*`` too, unless the head is tied
  (then mlx-lm drops it while loading, and no stage needs it);
- ``*.rotary_emb.inv_freq``: no stage (mlx-lm's sanitize drops it);
- anything else: every stage (``StageModel`` keeps it).

A checkpoint without an index is one file, which every stage reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from mlxceld.errors import ConfigError

INDEX: Final = "model.safetensors.index.json"
DAMAGED: Final = "the checkpoint is damaged or incomplete; download it again"
# A multimodal checkpoint (gemma3): its text model's tensors under TEXT_PREFIX, placed as
# any model's; its vision tower's on no stage (mlx-lm's sanitize drops them).
TEXT_PREFIX: Final = "language_model."
VISION_PREFIXES: Final = ("vision_tower.", "multi_modal_projector.")
DROPPED_SUFFIXES: Final = (".rotary_emb.inv_freq",)  # mlx-lm's sanitize drops them
# Layers past num_hidden_layers that predict further tokens (GLM-4.5, DeepSeek-V3 as
# published): mlx-lm's sanitize drops them, and no stage runs them.
NEXTN: Final = "num_nextn_predict_layers"
_LAYER: Final = re.compile(r"model\.layers\.(\d+)\.")

# Where a tensor goes (module docstring): a decoder layer, the embeddings, the final norm,
# the head, every stage ("other"), or no stage ("dropped").
Part = Literal["layer", "embed", "norm", "head", "other", "dropped"]


@dataclass(frozen=True)
class WeightIndex:
    """``model.safetensors.index.json``: each tensor's file, and the total size it states."""

    weight_map: Mapping[str, str]
    total_size: int  # metadata.total_size; 0 when the index states none

    @property
    def files(self) -> frozenset[str]:
        return frozenset(self.weight_map.values())


def read_json_object(file: Path, *, missing: ConfigError | None,
                     damaged: str = "the checkpoint is damaged; download it again"
                     ) -> tuple[bytes, dict[str, Any]] | None:
    """A checkpoint's JSON file as bytes and the object they hold; a missing file raises
    ``missing``, or is None when ``missing`` is None. An unreadable file, one that is not
    JSON or not an object raise a ``ConfigError`` naming it (``damaged``: the hint)."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError as exc:
        if missing is None:
            return None
        raise missing from exc
    except OSError as exc:
        raise ConfigError(f"{file} cannot be read: {exc.strerror or exc}",
                          hint="check its permissions") from exc
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file} is not valid JSON: {exc}", hint=damaged) from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{file} must hold a JSON object, not {type(value).__name__}",
                          hint=damaged)
    return raw, value


def read_index(path: Path) -> WeightIndex | None:
    """The index of the model directory ``path``; None when it has none (one file)."""
    file = Path(path) / INDEX
    read = read_json_object(file, missing=None, damaged=DAMAGED)
    if read is None:
        return None
    data = read[1]
    weight_map = data.get("weight_map")
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


@dataclass(frozen=True)
class Layout:
    """What config.json says of where tensors go: its layer count, the multi-token
    prediction layers past them (``num_nextn_predict_layers``), a head tied to the
    embeddings or not."""

    num_layers: int
    predictors: int
    tied: bool


def tensor_part(name: str, layout: Layout) -> tuple[Part, int]:
    """Where the tensor ``name`` goes (module docstring), and its layer (-1 when it is not
    a layer's). A layer past the last and its predictors is returned as it is: a damaged
    checkpoint, for the caller to refuse."""
    if name.startswith(VISION_PREFIXES) or name.endswith(DROPPED_SUFFIXES):
        return "dropped", -1
    name = name.removeprefix(TEXT_PREFIX)
    m = _LAYER.match(name)
    if m is not None:
        i = int(m.group(1))
        if layout.num_layers <= i < layout.num_layers + layout.predictors:
            return "dropped", -1  # a multi-token prediction layer
        return "layer", i
    if name.startswith("model.embed_tokens."):
        return "embed", -1
    if name.startswith("model.norm."):
        return "norm", -1
    if name.startswith("lm_head."):
        return ("dropped" if layout.tied else "head"), -1
    return "other", -1


def stage_files(index: WeightIndex, config: Mapping[str, Any], start: int, end: int,
                num_layers: int) -> frozenset[str]:
    """The shards that hold what the stage of layers [start, end) keeps (module docstring)."""
    first, last = start == 0, end == num_layers
    layout = layout_of(config, num_layers, index.weight_map)
    keeps: dict[Part, bool] = {"embed": first or (last and layout.tied), "norm": last,
                               "head": last, "other": True, "dropped": False}
    files: set[str] = set()
    for name, file in index.weight_map.items():
        part, layer = tensor_part(name, layout)
        if (start <= layer < end) if part == "layer" else keeps[part]:
            files.add(file)
    return frozenset(files)


def layout_of(config: Mapping[str, Any], num_layers: int, tensors: Iterable[str]) -> Layout:
    """The ``Layout`` of a checkpoint from its config.json and its tensor names."""
    return Layout(num_layers, _predictors(config), _tied(config, tensors))


def missing_files(path: Path, files: frozenset[str]) -> list[str]:
    """Those of ``files`` that the directory ``path`` does not hold, sorted."""
    return sorted(f for f in files if not (Path(path) / f).is_file())


def _tied(config: Mapping[str, Any], tensors: Iterable[str]) -> bool:
    """Tied as config.json says (mlx-lm builds the model from it); without the key, tied
    when the checkpoint names no head."""
    for table in (config, config.get("text_config")):
        if isinstance(table, Mapping) and "tie_word_embeddings" in table:
            return bool(table["tie_word_embeddings"])
    return not any(n.removeprefix(TEXT_PREFIX) == "lm_head.weight" for n in tensors)


def _predictors(config: Mapping[str, Any]) -> int:
    """``num_nextn_predict_layers`` (top or under ``text_config``); 0 when absent or not a
    count (the profile names a bad value; here it only decides what no stage needs)."""
    for table in (config, config.get("text_config")):
        if isinstance(table, Mapping):
            value = table.get(NEXTN)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return 0
