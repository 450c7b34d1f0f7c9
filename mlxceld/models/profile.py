"""What each part of a checkpoint costs in memory, from its safetensors headers alone.

``layer_profile(path)`` reads the headers of the weight files mlx-lm loads
(``model*.safetensors``; the index, when there is one, is checked against
them) and config.json, never the tensor data, and sorts every tensor's bytes
(quantized weights, scales and biases alike) the way ``slicing`` divides a
model between pipeline stages: by ``shards.tensor_part``, the one rule that
also decides which shards a stage reads (``shards.stage_files``):

- ``model.layers.{i}.*``: layer ``i``;
- ``model.embed_tokens.*``: the embeddings, on the first stage, and on the
  last stage too when the head is tied to them;
- ``model.norm.*`` and ``lm_head.*``: the final norm and the head, on the
  last stage (``head_bytes`` is 0 when tied: mlx-lm then drops any
  ``lm_head`` tensor while loading, as it drops ``rotary_emb.inv_freq``);
- ``model.layers.{n}.*`` for the ``num_nextn_predict_layers`` layers past the
  last (multi-token prediction, in glm4_moe and deepseek_v3 checkpoints as
  published): not counted, as mlx-lm drops them while loading;
- in a multimodal checkpoint (gemma3), ``language_model.*`` as above without
  that prefix; the vision tower not at all (mlx-lm drops it while loading);
- anything else: ``other_bytes``, counted on every stage, because
  ``StageModel`` prunes only layers, embeddings, norm and head, so every
  stage keeps whatever else the model holds.

``weight_bytes(start, end)`` is then the parameter bytes of a stage, which is
what ``StageModel.nbytes`` reports once it is loaded.

The profile needs every shard's header: it prices each tensor as it is stored
(a dense first layer, an MoE layer, a 4-bit layer), and the index states only
the total. So the host that plans (the coordinator: ``mlxctl cluster plan``,
``--pp-auto``) reads every shard's header: from its own files, or, for a model
named by its Hugging Face repo id (a snapshot of the cache holding only some
shards, or none: ``fetch.py``), the headers of the shards it lacks from the Hub
(``fetch.hub_headers``: a few KB per shard, never the weights; refused with
HF_HUB_OFFLINE=1, naming them). The hosts that only run stages hold just their
shards (``shards.py``). A planning host with a local directory that holds only
some shards is refused with the shards it lacks named, not priced by guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.models.fetch import Headers, hub_headers, snapshot_of
from mlxceld.models.identity import CONFIG, layer_count, read_model_config
from mlxceld.models.shards import (
    INDEX,
    NEXTN,
    TEXT_PREFIX,
    layout_of,
    missing_files,
    read_index,
    tensor_part,
)
from mlxceld.models.tensor_headers import DAMAGED, DTYPE_BYTES, TensorEntry, read_tensor_headers

WEIGHT_GLOB: Final = "model*.safetensors"  # what mlx-lm's load_model reads


@dataclass(frozen=True)
class LayerProfile:
    """The memory cost of a checkpoint's parts, in bytes.

    ``kv_bytes_per_token`` is one token's keys and values in one layer:
    2 * num_key_value_heads * head_dim * ``dtype_bytes``, where ``dtype_bytes``
    is the size of the activations' dtype (that of the embeddings, or of their
    quantization scales, or where those are not floats, as in mxfp4, of the first
    layer's norms), which mlx-lm's KV caches take. With multi-head latent
    attention (deepseek_v3: config.json has ``kv_lora_rank``) the cache holds
    the compressed latent and the rotated part of one key instead:
    (kv_lora_rank + qk_rope_head_dim) * ``dtype_bytes``. Sliding-window layers
    are priced as full ones (an upper bound: their cache stops at the window).
    """

    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    norm_bytes: int
    other_bytes: int
    tied: bool
    dtype_bytes: int
    hidden_size: int
    kv_bytes_per_token: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def total_bytes(self) -> int:
        """The whole model's parameter bytes (embeddings counted once)."""
        return self.weight_bytes(0, self.num_layers)

    def weight_bytes(self, start: int, end: int) -> int:
        """The parameter bytes of the stage that runs layers [start, end)."""
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"layers [{start}, {end}) are not a non-empty range within "
                             f"{self.num_layers} layers")
        first, last = start == 0, end == self.num_layers
        n = sum(self.layer_bytes[start:end]) + self.other_bytes
        if first or (last and self.tied):
            n += self.embed_bytes
        if last:
            n += self.norm_bytes + self.head_bytes
        return n


def layer_profile(path: Path, hub: Headers | None = None) -> LayerProfile:
    """The ``LayerProfile`` of the mlx-lm checkpoint in ``path`` (see the module docstring;
    ``hub``: where the Hub's headers come from, huggingface_hub's by default)."""
    path = Path(path)
    config = read_model_config(path)
    source = str(path / CONFIG)
    num_layers = layer_count(config, source=source)
    tensors = _tensors(path, hub)
    _config_int(config, NEXTN, source, default=0, least=0)  # a bad value is named here
    layout = layout_of(config, num_layers, tensors)
    tied = layout.tied
    layers = [0] * num_layers
    parts = {"embed": 0, "norm": 0, "head": 0, "other": 0}
    for name, entry in tensors.items():
        part, i = tensor_part(name, layout)
        if part == "dropped":
            continue
        if part != "layer":
            parts[part] += entry.nbytes
        elif i >= num_layers:
            raise ConfigError(f"model {path}: tensor {name!r} belongs to layer {i}, but "
                              f"{source} says {num_layers} layers", hint=DAMAGED)
        else:
            layers[i] += entry.nbytes
    _check_complete(path, layers, parts, tied)
    hidden = _config_int(config, "hidden_size", source)
    heads = _config_int(config, "num_attention_heads", source)
    kv_heads = _config_int(config, "num_key_value_heads", source, default=heads)
    head_dim = _config_int(config, "head_dim", source, default=hidden // heads)
    dtype_bytes = _activation_dtype_bytes(path, tensors)
    kv_width = 2 * kv_heads * head_dim
    if config.get("kv_lora_rank") is not None:
        kv_width = (_config_int(config, "kv_lora_rank", source)
                    + _config_int(config, "qk_rope_head_dim", source))
    return LayerProfile(
        layer_bytes=tuple(layers), embed_bytes=parts["embed"], head_bytes=parts["head"],
        norm_bytes=parts["norm"], other_bytes=parts["other"], tied=tied,
        dtype_bytes=dtype_bytes, hidden_size=hidden,
        kv_bytes_per_token=kv_width * dtype_bytes)


def _tensors(path: Path, hub: Headers | None) -> dict[str, TensorEntry]:
    """Every tensor of the weight files in ``path`` (and of the shards a repo id's snapshot
    lacks, from the Hub's headers), checked against the index if any."""
    index = read_index(path)
    headers = {file.name: read_tensor_headers(file) for file in sorted(path.glob(WEIGHT_GLOB))}
    if index is not None:
        absent = missing_files(path, index.files)
        snap = snapshot_of(path)
        if absent and snap is not None:  # a repo id's: priced from the Hub's headers
            headers.update(hub_headers(*snap, absent, hub))
        elif absent:
            raise ConfigError(
                f"model {path} holds {len(index.files) - len(absent)} of the "
                f"{len(index.files)} shards its {INDEX} names (missing: "
                f"{_some(absent)}): planning prices every layer from its shard's header",
                hint="plan on a host that holds the whole checkpoint (a host that only "
                "runs a stage needs only its own shards), or name the model by its "
                "Hugging Face repo id (the Hub's headers price the shards a host lacks)")
    if not headers:
        raise ConfigError(f"model directory {path} holds no {WEIGHT_GLOB} files",
                          hint="an mlx-lm checkpoint has config.json and safetensors weights "
                          "side by side")
    tensors: dict[str, TensorEntry] = {}
    where: dict[str, str] = {}
    for file, entries in headers.items():
        for name, entry in entries.items():
            if name in tensors:
                raise ConfigError(f"model {path}: tensor {name!r} is in both {where[name]} "
                                  f"and {file}", hint=DAMAGED)
            tensors[name], where[name] = entry, file
    if index is not None:
        for name, shard in sorted(index.weight_map.items()):
            if name not in where or where[name] != shard:
                raise ConfigError(f"{path / INDEX} places tensor {name!r} in {shard}, which "
                                  "does not hold it", hint=DAMAGED)
    return tensors


def _some(names: list[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _check_complete(path: Path, layers: list[int], parts: dict[str, int], tied: bool) -> None:
    missing = [i for i, n in enumerate(layers) if n == 0]
    if missing:
        raise ConfigError(f"model {path}: layer {missing[0]} has no tensors in its "
                          f"{WEIGHT_GLOB} files", hint=DAMAGED)
    if parts["embed"] == 0:
        raise ConfigError(f"model {path} has no model.embed_tokens tensors", hint=DAMAGED)
    if not tied and parts["head"] == 0:
        raise ConfigError(f"model {path}: config.json says the head is not tied to the "
                          "embeddings, but there is no lm_head tensor", hint=DAMAGED)


def _activation_dtype_bytes(path: Path, tensors: dict[str, TensorEntry]) -> int:
    """The size of the embeddings' floating dtype (their scales when quantized), or
    where they hold none (mxfp4: 8-bit power-of-two scales), the first layer's (its
    norms), which is the dtype ``StageModel`` gives the activations."""
    for prefix in ("model.embed_tokens.", "model.layers.0."):
        for name in sorted(tensors):
            entry = tensors[name]
            if name.removeprefix(TEXT_PREFIX).startswith(prefix) and entry.is_float:
                return DTYPE_BYTES[entry.dtype]
    raise ConfigError(f"model {path}: neither model.embed_tokens nor layer 0 has a "
                      "floating-point tensor",
                      hint="this checkpoint is not a supported mlx-lm model")


def _config_int(config: dict[str, Any], key: str, source: str, default: int | None = None,
                least: int = 1) -> int:
    """``key`` at the top of config.json or under ``text_config``: an integer, at least
    ``least`` (positive unless told)."""
    for where, table in (("", config), ("text_config.", config.get("text_config"))):
        if isinstance(table, dict) and table.get(key) is not None:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive integer" if least == 1 else f"an integer >= {least}"
                raise ConfigError(f"{source}: '{where}{key}' must be {kind}, "
                                  f"not {value!r}", hint=DAMAGED)
            return value
    if default is None:
        raise ConfigError(f"{source} has no '{key}'",
                          hint="mlxceld needs it to size the KV cache; is this a decoder-only "
                          "LLM checkpoint?")
    return default
