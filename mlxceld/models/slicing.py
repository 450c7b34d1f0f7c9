"""A pipeline stage's slice of an mlx-lm model: layers [start, end) and nothing else.

``load_stage(path, start, end)`` builds the model with mlx-lm's own classes and
loader, lazily, then prunes it: the other layers go, the embeddings stay only on
the first stage (and on the last when the head is tied to them), the final norm
and the head only on the last. Only what is left is evaluated, so the weights
of the other stages are never read from disk, and a directory that holds only
the stage's shards (``shards.stage_files``, beside config.json, the index and
the tokenizer) loads the stage as the whole checkpoint does. What is evaluated
goes layer by layer, reported to ``progress(done, total)`` (parameter bytes).
``forward`` is the family's own forward over the slice: the same masks, the same
layer calls, the same head.

Activations between stages are [b, n, hidden_size] in the stage's ``dtype``
(b sequences in one batch, their caches merged); the first stage takes int32
token ids [b, n]; the last returns the log-probabilities of the last position
[b, vocab_size], computed in the model's dtype as mlx-lm computes them and
handed over as float32. ``input_spec`` bounds
what a stage accepts, for the network layer to check before it copies.

Families (``FAMILIES``, keyed by ``families.SUPPORTED``'s names, the one list):
every one has mlx-lm's common shape, ``model.model.{embed_tokens, layers, norm}``
plus ``lm_head`` or tied embeddings, and an inner loop ``layer(h, mask, cache)``.
What differs between them is a ``Family``: the embeddings scaled (gemma3), masks
as arrays rather than ``"causal"`` (deepseek_v3's multi-head latent attention adds
them to its positional scores), and which layers attend over a sliding window
(llama's ``layer_types``, gemma3's every n-th global layer, gpt_oss's
``layer_types``). Each layer's cache is the one the family's own ``make_cache``
makes for that layer of the whole model (a window's ``RotatingKVCache``, else a
``KVCache``; deepseek_v3 keeps its compressed latent in a ``KVCache``).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_config, load_model

from mlxceld.errors import ConfigError
from mlxceld.models.families import SUPPORTED, check_family, split_as
from mlxceld.models.identity import layer_count
from mlxceld.models.reading import Progress, read_weights
from mlxceld.models.shards import INDEX, missing_files, read_index, stage_files
from mlxceld.models.tensor import check_model_dir
from mlxceld.wire.envelope import TensorSpec
from mlxceld.wire.mx_tensors import wire_dtype

log = logging.getLogger(__name__)

__all__ = ["MAX_STEP_TOKENS", "SUPPORTED", "StageModel", "load_stage"]

# The families this module splits: one list, families.SUPPORTED (the daemon reads it
# without importing mlx), re-exported here; FAMILIES below holds each one's hooks.


def _no_window(inner: Any, index: int) -> bool:
    return False


def _uses_sliding(inner: Any, index: int) -> bool:
    """llama: ``layer_types`` in config.json made the layer a window's (``use_sliding``)."""
    return bool(getattr(inner.layers[index], "use_sliding", False))


def _gemma_sliding(inner: Any, index: int) -> bool:
    """gemma3: every ``sliding_window_pattern``-th layer global, the others a window's."""
    return bool(inner.layers[index].self_attn.is_sliding)


def _typed_sliding(inner: Any, index: int) -> bool:
    """gpt_oss: ``layer_types`` in config.json (alternating when absent)."""
    return bool(inner.layer_types[index] == "sliding_attention")


@dataclass(frozen=True)
class Family:
    """How a family's inner model differs from the common loop (see the module docstring).

    ``sliding(inner, i)``: whether layer ``i`` of the whole model attends over a
    window, asked of the unpruned inner model; ``window``: the inner model's
    attribute holding the window's size. ``scaled_embeddings``: the embeddings are
    multiplied by sqrt(hidden_size) rounded to bfloat16, as gemma does.
    ``array_masks``: masks are boolean arrays, never the ``"causal"`` shortcut.
    ``text_model``: where a multimodal ``Model`` keeps the text model that has the
    common shape (gemma3: ``language_model``; its vision tower is never loaded).
    """

    sliding: Callable[[Any, int], bool] = _no_window
    window: str | None = None
    scaled_embeddings: bool = False
    array_masks: bool = False
    text_model: str | None = None


# model_type -> Family. mistral loads with llama's classes.
FAMILIES: dict[str, Family] = {
    "llama": Family(sliding=_uses_sliding, window="sliding_window"),
    "mistral": Family(sliding=_uses_sliding, window="sliding_window"),
    "qwen2": Family(),
    "qwen3": Family(),
    "qwen3_moe": Family(),
    "mixtral": Family(),
    "glm4_moe": Family(),
    "phi3": Family(),
    "gemma3_text": Family(sliding=_gemma_sliding, window="window_size",
                          scaled_embeddings=True),
    "gemma3": Family(sliding=_gemma_sliding, window="window_size", scaled_embeddings=True,
                     text_model="language_model"),
    "deepseek_v3": Family(array_masks=True),
    "gpt_oss": Family(sliding=_typed_sliding, window="window_size"),
}
# The most tokens one forward step takes (a prefill chunk); what input_spec allows.
MAX_STEP_TOKENS = 8192


class StageModel:
    """Layers [start, end) of an mlx-lm model, plus embeddings on the first stage
    and final norm + lm_head on the last.

    Prunes ``model`` (an mlx-lm ``Model``, loaded lazily) in place and keeps it as
    ``model``: its parameter tree then holds only what this stage runs (its layers
    renumbered from 0). Call ``forward``, never ``model`` itself.
    """

    def __init__(self, model: Any, start: int, end: int) -> None:
        self.model_type: str = model.model_type
        self.family: Family = _family(self.model_type)
        # The text model with the common shape: the model itself, or a multimodal one's.
        text = getattr(model, self.family.text_model) if self.family.text_model else model
        inner = text.model
        self.num_layers: int = len(inner.layers)
        _check_range(start, end, self.num_layers)
        self.start, self.end = start, end
        self.first, self.last = start == 0, end == self.num_layers
        self.tied: bool = "lm_head" not in text
        self.hidden_size: int = text.args.hidden_size
        self.vocab_size: int = text.args.vocab_size
        self.model = model
        self._text = text
        # Asked of the whole model, before pruning: what each own layer is.
        self._sliding = [self.family.sliding(inner, i) for i in range(start, end)]
        self._window: int | None = (getattr(inner, self.family.window)
                                    if self.family.window else None)
        self._caches = self._whole_model_caches()[start:end]
        inner.layers = inner.layers[start:end]
        if not (self.first or (self.last and self.tied)):
            del inner.embed_tokens
        if not self.last:
            del inner.norm
            if not self.tied:
                del text.lm_head
        self.layers: list[Any] = list(inner.layers)
        self.dtype: Any = _float_dtype(self.layers[0])
        self.wire_dtype: str = _wire_name(self.dtype)
        self._check_experts()

    def _check_experts(self) -> None:
        """Refuse, before any weight is read, experts that mlx cannot run here: its CPU
        backend multiplies unquantized experts (``gather_mm``) in float32 only."""
        for layer in self.layers:
            for _, module in layer.named_modules():
                if isinstance(module, SwitchLinear) and not _gather_mm_runs(module.weight.dtype):
                    raise ConfigError(
                        f"model {self.model_type}: its experts are {module.weight.dtype}, "
                        f"which mlx cannot multiply on this machine ({mx.default_device()})",
                        hint="use a float32 or a quantized copy of the checkpoint "
                             "(mlx_lm.convert --dtype float32, or -q), or a Mac's GPU")

    def _whole_model_caches(self) -> list[Any]:
        caches: list[Any] = make_prompt_cache(self.model)
        if len(caches) != self.num_layers:
            raise ConfigError(f"model {self.model_type}: its make_cache gives {len(caches)} "
                              f"caches for {self.num_layers} layers",
                              hint="this mlx-lm model class cannot be split into stages")
        return caches

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters this stage holds."""
        return sum(v.nbytes for v in _leaves(self.model.parameters()))

    def make_cache(self) -> list[Any]:
        """One fresh mlx-lm cache per own layer: the kind the family's ``make_cache``
        gives that layer of the whole model."""
        return [copy.deepcopy(c) for c in self._caches]

    def input_spec(self, max_tokens: int = MAX_STEP_TOKENS) -> TensorSpec:
        """What ``forward`` accepts, as the wire checks it: token ids on the first
        stage, else hidden states in this stage's dtype; at most ``max_tokens``."""
        if self.first:
            return TensorSpec(frozenset({"i32"}), ((1, 1), (1, max_tokens)))
        return TensorSpec(frozenset({self.wire_dtype}),
                          ((1, 1), (1, max_tokens), (self.hidden_size, self.hidden_size)))

    def forward(self, x: Any, cache: list[Any], *, overlap: bool = False,
                raw: bool = False, caches_only: bool = False, every: bool = False) -> Any:
        """Run this stage's layers over ``x`` with ``cache`` (from ``make_cache``).

        First stage: ``x`` is int32 token ids [b, n]; else hidden [b, n, hidden_size].
        Returns hidden [b, n, hidden_size], or on the last stage the log-probabilities of
        the last position [b, vocab_size] (mlx-lm's, in the model's dtype, as float32);
        evaluated. ``raw``: the last stage's logits instead, in the model's dtype (what
        logits processors act on; ``log_softmax`` then gives the log-probabilities).
        ``caches_only``: None, only the caches evaluated (the last stage's prefill chunk
        that samples nothing: no head, nor the last layer's output). ``every``: the last
        stage's raw logits at every position [b, n, vocab] (a speculative pass checks
        each proposal: ``pipeline/speculating.py``).

        ``overlap``: hand each layer to mlx as soon as its graph is built
        (``mx.async_eval``), so that building the next layer's graph in Python overlaps
        running this one. Worth it where a layer runs for milliseconds (bench: +4-8%
        decode tok/s on the small fixture's 2-stage pipeline); where it runs for
        microseconds the extra hand-offs to mlx's stream thread cost more than they
        hide (tiny: +0.5 ms a step). Results are the same either way.
        """
        self._check_input(x, cache)
        inner = self._text.model
        if caches_only:  # only the caches of ``x`` (a prefill chunk no token is sampled at)
            self._layers(x, cache, overlap)
            mx.eval([c.state for c in cache])
            return None
        if self.last and every:
            h = inner.norm(self._layers(x, cache, overlap))
            logits = inner.embed_tokens.as_linear(h) if self.tied else self._text.lm_head(h)
            mx.eval(logits)
            return logits
        if self.last and x.shape[1] > 1:
            # Only the caches are needed of all positions but the last: evaluating just
            # them (as mlx-lm's prefill does) skips the last layer's attention output and
            # MLP there. The last position then runs on its own.
            self._layers(x[:, :-1], cache, overlap)
            mx.eval([c.state for c in cache])
            x = x[:, -1:]
        h = self._layers(x, cache, overlap)
        if not self.last:
            mx.eval(h)
            return h
        # Norm and head act per position: only the last one is needed.
        h = inner.norm(h[:, -1:, :])
        logits = inner.embed_tokens.as_linear(h) if self.tied else self._text.lm_head(h)
        logits = logits[:, -1, :]
        if raw:
            mx.eval(logits)
            return logits
        return log_softmax(logits)

    def _layers(self, x: Any, cache: list[Any], overlap: bool) -> Any:
        inner = self._text.model
        h = inner.embed_tokens(x) if self.first else x
        if self.first and self.family.scaled_embeddings:
            h = h * mx.array(self.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        masks: dict[bool, Any] = {}  # by sliding: made from that kind's first cache
        last = len(self.layers) - 1
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            sliding = self._sliding[i]
            if sliding not in masks:
                masks[sliding] = create_attention_mask(
                    h, c, window_size=self._window if sliding else None,
                    return_array=self.family.array_masks)
            h = layer(h, masks[sliding], c)
            # Not the last layer's output: the caller evaluates what it needs of it (on
            # the last stage's prefill, only its cache: its output there is not needed).
            if overlap and i < last:
                mx.async_eval(h)  # type: ignore[no-untyped-call]
        return h

    def _check_input(self, x: Any, cache: list[Any]) -> None:
        if len(cache) != len(self.layers):
            raise ValueError(f"stage [{self.start}, {self.end}): {len(cache)} caches for "
                             f"{len(self.layers)} layers; use make_cache()")
        want = "[b, n] int32" if self.first else f"[b, n, {self.hidden_size}] {self.dtype}"
        shape_ok = (x.ndim == 2 if self.first else
                    x.ndim == 3 and x.shape[2] == self.hidden_size)
        dtype_ok = x.dtype == (mx.int32 if self.first else self.dtype)
        if not (shape_ok and dtype_ok and x.shape[0] >= 1 and x.shape[1] >= 1):
            raise ValueError(f"stage [{self.start}, {self.end}): input {list(x.shape)} "
                             f"{x.dtype}, expected {want}")


def load_stage(path: str | Path, start: int, end: int,
               progress: Progress | None = None, *, group: Any = None) -> StageModel:
    """Load layers [start, end) of the mlx-lm checkpoint at ``path`` and only those;
    ``progress(done, total)`` hears of each layer loaded (parameter bytes).

    ``group``: an ``mx.distributed`` group whose every rank loads the same slice; its
    layers are then split over the group by mlx-lm's own ``shard`` before any weight is
    read, so this rank reads only its slices of them (about 1/N of each layer; the
    embeddings, norm and head stay whole). The model must be one mlx-lm splits and the
    group's size must divide its heads and MLP (``models/tensor.py``:
    ``TensorParallelRefused``). ``pipeline/tensor_stage.py`` runs such a stage."""
    path = Path(path)
    config = _read_config(path)
    model_type = check_family(config, str(path / "config.json"))  # UnsupportedFamily
    if group is not None:
        check_model_dir(path, group.size())  # TensorParallelRefused
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int):
        _check_range(start, end, layers, path)  # before any weight is touched
    strict = _holds_every_shard(path, config, start, end)
    try:
        model, _ = load_model(path, lazy=True, strict=strict)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {path}: mlx-lm cannot load it: {exc}",
                          hint="check that it is a complete mlx-lm checkpoint") from exc
    stage = StageModel(model, start, end)
    if group is not None:  # mlx-lm's split of the layers kept (the others are gone)
        model.shard(group)
    _evaluate(stage, progress)
    log.info("loaded stage [%d, %d) of %d layers of %s (%s): %d parameter bytes%s%s",
             start, end, stage.num_layers, path, model_type, stage.nbytes,
             "" if strict else ", from this stage's shards only",
             "" if group is None else f", rank {group.rank()} of a tensor-parallel "
             f"group of {group.size()}")
    return stage


@functools.cache
def _gather_mm_runs(dtype: Any) -> bool:
    """Whether mlx's ``gather_mm`` (unquantized experts) runs in ``dtype`` on this device."""
    a, b = mx.zeros((1, 1, 2), dtype), mx.zeros((1, 2, 2), dtype)
    try:
        mx.eval(mx.gather_mm(a, b, rhs_indices=mx.array([0], dtype=mx.uint32)))
    except RuntimeError:
        return False
    return True


def _family(model_type: str) -> Family:
    family = FAMILIES.get(split_as(model_type))
    if family is None:
        raise ConfigError(f"model_type {model_type!r} cannot be split into pipeline stages",
                          hint=f"supported model types: {', '.join(SUPPORTED)}")
    return family


def _holds_every_shard(path: Path, config: dict[str, Any], start: int, end: int) -> bool:
    """Whether ``path`` holds every shard its index names (then mlx-lm loads it strictly,
    each weight checked against the model); when it holds only some, those this stage
    needs must be there (the index says each weight they hold is), or the load is
    refused here, naming them."""
    index = read_index(path)
    if index is None:
        return True
    absent = missing_files(path, index.files)
    if not absent:
        return True
    needed = stage_files(index, config, start, end, layer_count(config, source=str(path)))
    lacking = [f for f in absent if f in needed]
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise ConfigError(
            f"model {path}: stage layers [{start}, {end}) need {len(needed)} of the "
            f"{len(index.files)} shards its {INDEX} names, and {len(lacking)} of them are "
            f"missing: {', '.join(lacking[:3])}{more}",
            hint="copy them into the model directory: a stage reads the shards of its "
            "layers and of the embeddings, norm and head it keeps (mlxceld/models/shards.py)")
    return False


def _evaluate(stage: StageModel, progress: Progress | None) -> None:
    """Read the stage's weights from disk: layer by layer, then the rest (embeddings,
    norm, head), each step reported to ``progress`` (``reading.read_weights``)."""
    read_weights(stage.layers, stage.model, progress)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = load_config(path)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model {path}: cannot read config.json: {exc}",
                          hint="point at an mlx-lm model directory") from exc
    return config


def _check_range(start: int, end: int, count: int, path: Path | None = None) -> None:
    if not 0 <= start < end <= count:
        where = f"model {path}" if path is not None else "model"
        raise ConfigError(f"{where}: stage layers [{start}, {end}) are not a non-empty range "
                          f"within its {count} layers",
                          hint=f"use 0 <= start < end <= {count}")


def _float_dtype(layer: Any) -> Any:
    """The dtype the layer computes in: that of its first floating-point parameter
    (a norm weight, or quantization scales when its matrices are packed)."""
    for value in _leaves(layer.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    raise ConfigError("model layer has no floating-point parameters",
                      hint="this checkpoint is not a supported mlx-lm model")


def _leaves(tree: Any) -> list[Any]:
    """The arrays of a parameter tree."""
    return [value for _, value in cast(list[tuple[str, Any]], tree_flatten(tree))]


def _wire_name(dtype: Any) -> str:
    name = wire_dtype(dtype)
    if name is None:
        raise ConfigError(f"model activations of dtype {dtype} cannot travel between stages",
                          hint="use a float32, bfloat16 or float16 checkpoint")
    return name


def log_softmax(logits: Any) -> Any:
    """The log-probabilities of ``logits`` [b, vocab] as mlx-lm's steps compute them,
    evaluated: subtracted in the model's dtype, as mlx-lm's own steps (generate_step,
    BatchGenerator) do, then widened (exactly). Greedy decoding is the argmax of this
    rounded result, and subtracting in float32 instead made a bfloat16 model's tokens part
    from mlx-lm's (and the single-host engine's) within 24 tokens for 1 to 5 of 5 prompts
    (tests/pipeline/test_compute.py)."""
    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float32)
    mx.eval(logprobs)
    return logprobs
