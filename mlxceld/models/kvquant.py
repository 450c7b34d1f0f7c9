"""Which models keep a quantized KV cache (``[serve] kv_bits``), and what one costs.

mlx-lm 0.32.2 quantizes a layer's cache only where it is a plain ``KVCache`` (its
``to_quantized``) and the layer's attention goes through mlx-lm's
``scaled_dot_product_attention``, whose quantized path takes keys and values as
(packed integers, scales, biases). A family is refused by name where that does not
hold (``KV_REFUSED``, for the families a pipeline splits, ``families.SUPPORTED``):

- gemma3_text, gemma3: their sliding-window layers keep a ``RotatingKVCache``, which
  has no quantized form;
- gpt_oss: its attention adds sinks, which the quantized attention refuses (and its
  sliding-window layers keep a ``RotatingKVCache``);
- deepseek_v3 (and what loads as it: kimi_k2, ...): its multi-head latent attention
  keeps a compressed latent in its cache and multiplies it directly;
- llama and mistral checkpoints whose ``layer_types`` has sliding-window layers
  (a ``RotatingKVCache`` for those).

A model's head size must also be a multiple of ``kv_group_size`` (mlx quantizes each
row in groups). ``kv_problem`` judges config.json (no weight is read, no mlx is
imported: the daemon and the pipeline's router call it); the engines judge the loaded
model itself too (``engine/kvquant.py``: ``kv_refusal``), which covers every other
mlx-lm family. ``tests/models/test_kvquant_check.py`` holds this table to mlx-lm.

A quantized cache holds, per element, ``bits / 8`` bytes, plus a scale and a bias (in
the model's activation dtype) per ``group_size`` elements (``kv_bytes``): at 8 bits and
groups of 64, 0.53 of a bfloat16 cache; at 4 bits, 0.28.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.models.families import model_family, split_as
from mlxceld.roles.options import KVQuant

_WINDOW: Final = ("its sliding-window layers keep a RotatingKVCache, which mlx-lm cannot "
                  "quantize")
# The families of families.SUPPORTED whose cache mlx-lm 0.32.2 cannot quantize, and why.
KV_REFUSED: Final[dict[str, str]] = {
    "gemma3_text": _WINDOW,
    "gemma3": _WINDOW,
    "gpt_oss": ("its attention adds sinks, which mlx-lm's quantized attention does not take "
                "(and " + _WINDOW.removeprefix("its ") + ")"),
    "deepseek_v3": ("its multi-head latent attention keeps a compressed latent in its cache "
                    "and multiplies it directly, not through mlx-lm's quantized attention"),
}
# llama's classes (mistral's too) give a layer a RotatingKVCache when layer_types says so.
_TYPED_WINDOWS: Final = frozenset({"llama", "mistral"})
KV_HINT: Final = ("leave kv_bits out ([serve] kv_bits, --kv-bits) to serve this model with a "
                  "full-precision KV cache")


def kv_problem(config: Mapping[str, Any], kv: KVQuant) -> str | None:
    """Why the model whose config.json is ``config`` cannot keep ``kv``'s cache, or None
    when nothing in config.json says so (the loaded model is judged too: see above)."""
    family = model_family(config)
    if family is not None:
        reason = KV_REFUSED.get(split_as(family))
        if reason is not None:
            return f"model family {family!r} cannot keep a quantized KV cache: {reason}"
        types = config.get("layer_types")
        if split_as(family) in _TYPED_WINDOWS and isinstance(types, list) \
                and "sliding_attention" in types:
            return (f"model family {family!r} cannot keep a quantized KV cache here: its "
                    f"layer_types has sliding-window layers, and {_WINDOW}")
    head = head_size(config)
    if head is not None and head % kv.group_size:
        return (f"its attention heads have {head} elements, which kv_group_size "
                f"{kv.group_size} does not divide (mlx quantizes each row in groups)")
    return None


def check_kv_quant(config: Mapping[str, Any], kv: KVQuant | None, *, source: str,
                   what: str = "serve.kv_bits") -> None:
    """``kv_problem`` as a ``ConfigError`` naming ``what`` (where kv_bits was said), the
    model (``source``: its config.json) and the reason, with what to do; nothing when
    ``kv`` is None (no quantized cache asked)."""
    if kv is None:
        return
    problem = kv_problem(config, kv)
    if problem is not None:
        raise ConfigError(f"{what} = {kv.bits}: {source}: {problem}",
                          hint=group_hint(problem, kv) or KV_HINT)


def group_hint(problem: str, kv: KVQuant) -> str | None:
    """The hint for a head size that ``kv.group_size`` does not divide (None: another
    problem)."""
    if "kv_group_size" not in problem:
        return None
    return (f"set [serve] kv_group_size (--kv-group-size) to a size that divides the head "
            f"size (32, 64 or 128; it is {kv.group_size}), or " + KV_HINT)


def head_size(config: Mapping[str, Any]) -> int | None:
    """The attention head's size in config.json (``head_dim``, else hidden size over
    heads; at the top or under ``text_config``); None where it cannot be told."""
    text = config.get("text_config")
    for table in (config, text):
        if not isinstance(table, Mapping):
            continue
        head = table.get("head_dim")
        if isinstance(head, int) and not isinstance(head, bool) and head > 0:
            return head
        hidden, heads = table.get("hidden_size"), table.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 \
                and not isinstance(hidden, bool) and not isinstance(heads, bool):
            return hidden // heads
    return None


def kv_bytes(elements: int, dtype_bytes: int, kv: KVQuant | None) -> int:
    """The bytes of ``elements`` cached key and value elements (one token's, in one layer):
    ``dtype_bytes`` each, or quantized by ``kv``: ``kv.bits / 8`` each plus a scale and a
    bias of ``dtype_bytes`` per ``kv.group_size`` (mlx-lm's ``QuantizedKVCache``)."""
    if kv is None:
        return elements * dtype_bytes
    groups = -(-elements // kv.group_size)
    return elements * kv.bits // 8 + 2 * groups * dtype_bytes
