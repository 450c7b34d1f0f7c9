"""A pipeline stage's slice of an mlx-lm model: layers [start, end) and nothing else.

``load_stage(path, start, end)`` builds the model with mlx-lm's own classes and
loader, lazily, then prunes it: the other layers go, the embeddings stay only on
the first stage (and on the last when the head is tied to them), the final norm
and the head only on the last. Only what is left is evaluated, so the weights
of the other stages are never read from disk. ``forward`` is the family's own
forward over the slice: the same masks, the same layer calls, the same head.

Activations between stages are [b, n, hidden_size] in the stage's ``dtype``
(b sequences in one batch, their caches merged); the first stage takes int32
token ids [b, n]; the last returns the log-probabilities of the last position
[b, vocab_size], computed in the model's dtype as mlx-lm computes them and
handed over as float32. ``input_spec`` bounds
what a stage accepts, for the network layer to check before it copies.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_config, load_model

from mlxceld.errors import ConfigError
from mlxceld.wire.envelope import TensorSpec
from mlxceld.wire.mx_tensors import wire_dtype

log = logging.getLogger(__name__)

# Families whose Model is model.{embed_tokens, layers, norm} plus lm_head or tied
# embeddings, and whose inner loop is layer(h, mask, cache). mistral loads as llama.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
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
        inner = model.model
        self.num_layers: int = len(inner.layers)
        _check_range(start, end, self.num_layers)
        self.start, self.end = start, end
        self.first, self.last = start == 0, end == self.num_layers
        self.tied: bool = "lm_head" not in model
        self.hidden_size: int = model.args.hidden_size
        self.vocab_size: int = model.args.vocab_size
        self.model = model
        inner.layers = inner.layers[start:end]
        if not (self.first or (self.last and self.tied)):
            del inner.embed_tokens
        if not self.last:
            del inner.norm
            if not self.tied:
                del model.lm_head
        self.layers: list[Any] = list(inner.layers)
        self.dtype: Any = _float_dtype(self.layers[0])
        self.wire_dtype: str = _wire_name(self.dtype)
        self._window: int | None = getattr(inner, "sliding_window", None)

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters this stage holds."""
        return sum(v.nbytes for v in _leaves(self.model.parameters()))

    def make_cache(self) -> list[Any]:
        """One mlx-lm KV cache per own layer, as ``model.make_cache`` makes them."""
        caches: list[Any] = make_prompt_cache(self.model)
        return caches

    def input_spec(self, max_tokens: int = MAX_STEP_TOKENS) -> TensorSpec:
        """What ``forward`` accepts, as the wire checks it: token ids on the first
        stage, else hidden states in this stage's dtype; at most ``max_tokens``."""
        if self.first:
            return TensorSpec(frozenset({"i32"}), ((1, 1), (1, max_tokens)))
        return TensorSpec(frozenset({self.wire_dtype}),
                          ((1, 1), (1, max_tokens), (self.hidden_size, self.hidden_size)))

    def forward(self, x: Any, cache: list[Any], *, overlap: bool = False) -> Any:
        """Run this stage's layers over ``x`` with ``cache`` (from ``make_cache``).

        First stage: ``x`` is int32 token ids [b, n]; else hidden [b, n, hidden_size].
        Returns hidden [b, n, hidden_size], or on the last stage the log-probabilities of
        the last position [b, vocab_size] (mlx-lm's, in the model's dtype, as float32);
        evaluated.

        ``overlap``: hand each layer to mlx as soon as its graph is built
        (``mx.async_eval``), so that building the next layer's graph in Python overlaps
        running this one. Worth it where a layer runs for milliseconds (bench: +4-8%
        decode tok/s on the small fixture's 2-stage pipeline); where it runs for
        microseconds the extra hand-offs to mlx's stream thread cost more than they
        hide (tiny: +0.5 ms a step). Results are the same either way.
        """
        self._check_input(x, cache)
        inner = self.model.model
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
        logits = inner.embed_tokens.as_linear(h) if self.tied else self.model.lm_head(h)
        logits = logits[:, -1, :]
        # Subtracted in the model's dtype, as mlx-lm's own steps (generate_step,
        # BatchGenerator) do, then widened (exactly): greedy decoding is the argmax of this
        # rounded result, and subtracting in float32 instead made a bfloat16 model's tokens
        # part from mlx-lm's (and the single-host engine's) within 24 tokens for 1 to 5 of
        # 5 prompts (tests/pipeline/test_compute.py).
        logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float32)
        mx.eval(logprobs)
        return logprobs

    def _layers(self, x: Any, cache: list[Any], overlap: bool) -> Any:
        inner = self.model.model
        h = inner.embed_tokens(x) if self.first else x
        masks: dict[bool, Any] = {}  # by use_sliding: made from that kind's first cache
        last = len(self.layers) - 1
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            sliding = bool(getattr(layer, "use_sliding", False))
            if sliding not in masks:
                window = self._window if sliding else None
                masks[sliding] = create_attention_mask(h, c, window_size=window)
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


def load_stage(path: str | Path, start: int, end: int) -> StageModel:
    """Load layers [start, end) of the mlx-lm checkpoint at ``path`` and only those."""
    path = Path(path)
    config = _read_config(path)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(f"model {path}: model_type {model_type!r} cannot be split into "
                          "pipeline stages",
                          hint=f"supported model types: {', '.join(SUPPORTED)}")
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int):
        _check_range(start, end, layers, path)  # before any weight is touched
    try:
        model, _ = load_model(path, lazy=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {path}: mlx-lm cannot load it: {exc}",
                          hint="check that it is a complete mlx-lm checkpoint") from exc
    stage = StageModel(model, start, end)
    mx.eval(stage.model.parameters())
    log.info("loaded stage [%d, %d) of %d layers of %s (%s): %d parameter bytes",
             start, end, stage.num_layers, path, model_type, stage.nbytes)
    return stage


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
