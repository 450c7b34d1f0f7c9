"""Reading a lazily built mlx-lm model's weights from disk, layer by layer, saying how far.

mlx-lm builds a model lazily (``load_model(..., lazy=True)``): nothing is read until
its parameters are evaluated. ``read_weights`` evaluates them one layer at a time,
then the rest (embeddings, norm, head), and tells ``progress(done, total)`` after each
step, in parameter bytes: 0 of ``total`` first, ``total`` of ``total`` last. A pipeline
stage (``slicing.load_stage``) and the single-host engine (``engine/local.py``) load
through it, so that ``mlxctl status``, systemd's STATUS line and ``mlxctl serve`` can
say "loading 43% of 61.0 GiB". Imports mlx: only where a model is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

Progress = Callable[[int, int], None]  # (bytes loaded, bytes to load)


def parameter_bytes(tree: Any) -> int:
    """The bytes of a parameter tree's arrays (known before they are read)."""
    return sum(v.nbytes for _, v in cast(list[tuple[str, Any]], tree_flatten(tree)))


def read_weights(layers: Sequence[Any], whole: Any, progress: Progress | None) -> int:
    """Evaluate each of ``layers``, then the rest of ``whole`` (the module that holds
    them), reporting to ``progress`` after each; the bytes read (``whole``'s)."""
    total = parameter_bytes(whole.parameters())
    done = 0
    if progress is not None:
        progress(done, total)
    for layer in layers:
        params = layer.parameters()
        mx.eval(params)
        done = min(total, done + parameter_bytes(params))
        if progress is not None:
            progress(done, total)
    mx.eval(whole.parameters())
    if progress is not None:
        progress(total, total)
    return total


def model_layers(model: Any) -> Sequence[Any]:
    """The transformer layers of an mlx-lm model (its ``layers``, as mlx-lm's own
    ``pipeline()`` finds them); empty where it has none: then it is read in one step."""
    layers = getattr(model, "layers", None)
    try:
        return list(layers) if layers is not None else []
    except TypeError:
        return []
