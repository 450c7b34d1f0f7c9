"""A quantized KV cache: ``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``.

``[serve]`` in the config file (flags win)::

    [serve]
    kv_bits = 8                     # 4 or 8; absent (default): a full-precision cache
    kv_group_size = 64              # 32, 64 (default) or 128 elements per scale and bias
    quantized_kv_start = 0          # tokens a layer's cache holds before it is quantized

With ``kv_bits``, every sequence's KV cache keeps each key and value as a ``kv_bits``-bit
integer with a scale and a bias (in the model's dtype) per ``kv_group_size`` elements, as
mlx-lm's ``QuantizedKVCache`` does: at 8 bits and groups of 64 about 0.53 of a 16-bit
cache's bytes, at 4 bits about 0.28, so a host holds about twice (four times) the tokens
of context, at some cost in accuracy (4 bits costs more). It applies wherever the model
runs: the local engine (continuous batching and the prompt cache included), every rank of
a tensor-parallel group, and every stage of a pipeline this daemon's router drives (each
sequence's ``prepare`` carries it); the planner (``mlxctl cluster plan``, ``--pp-auto``)
prices the KV reserve at this width. On a decode node a handed-off cache is quantized from
its next step; on a prefill node the cache it hands off is not (``kv_compression`` is that
wire's setting).

``quantized_kv_start`` has mlx-lm's meaning (``mlx_lm.generate --quantized-kv-start``): a
layer's cache is quantized once it holds at least that many tokens, checked as each model
step begins (``mlxceld/engine/kvquant.py``). Our default is 0, quantized from the first
token, where mlx-lm's command line defaults to 5000: someone who asks for kv_bits wants
the memory, and a long prompt is where it is needed. Below the start a short chat keeps
full precision; past it the memory is saved. With a start above 0, a sequence batched
with a longer one is quantized with it (the batch is one kind), so its tokens may differ
from its run alone; with 0 batching changes nothing.

Refused at start (exit 2, naming the key or flag), and on a SIGHUP reload:

- a value out of range, or ``kv_group_size``/``quantized_kv_start`` without ``kv_bits``;
- with ``node_role = "router"`` (no model there: set it on the replicas);
- a model that cannot keep a quantized cache (``models/kvquant.py``: a sliding-window,
  latent-attention or attention-sink family, or a head size the group size does not
  divide), judged from config.json for a local directory here; the router worker judges
  any model again as it loads it (a repo id, a pipeline's), and exits naming
  ``serve.kv_bits`` and the family.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.models.identity import read_model_config
from mlxceld.models.kvquant import check_kv_quant
from mlxceld.roles.options import DEFAULT_KV_GROUP_SIZE, KV_BITS, KV_GROUP_SIZES, KVQuant
from mlxceld.types import ROUTER_ROLE

KEYS: Final = ("kv_bits", "kv_group_size", "quantized_kv_start")
FLAGS: Final = {"kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size",
                "quantized_kv_start": "--quantized-kv-start"}
HINT: Final = ("for example kv_bits = 8 (--kv-bits 8), kv_group_size = 64, "
               "quantized_kv_start = 0; see mlxceld/config/kvquant.py")


def parse_kv_quant(flags: Mapping[str, int | None], table: Mapping[str, Any],
                   where: str) -> KVQuant | None:
    """``flags`` (by key: ``kv_bits``, ... ; None: not given) over ``[serve]``'s keys: the
    quantized KV cache asked for, or None (full precision)."""
    values: dict[str, int | None] = {}
    for key in KEYS:
        flag = flags.get(key)
        value: object = flag if flag is not None else table.get(key)
        what = FLAGS[key] if flag is not None else f"{where}: 'serve.{key}'"
        if value is not None:
            _check(key, value, what)
            assert isinstance(value, int)
        values[key] = value
    bits = values["kv_bits"]
    if bits is None:
        for key in KEYS[1:]:
            if values[key] is not None:
                what = FLAGS[key] if flags.get(key) is not None else f"{where}: 'serve.{key}'"
                raise ConfigError(f"{what} means nothing without kv_bits: the KV cache is "
                                  "full precision", hint="set kv_bits = 4 or 8 too (--kv-bits), "
                                  f"or leave {key} out")
        return None
    return KVQuant(bits, values["kv_group_size"] or DEFAULT_KV_GROUP_SIZE,
                   values["quantized_kv_start"] or 0)


def _check(key: str, value: object, what: str) -> None:
    whole = isinstance(value, int) and not isinstance(value, bool)
    if key == "kv_bits" and not (whole and value in KV_BITS):
        raise ConfigError(f"{what} must be 4 or 8 (bits per cached key and value element), "
                          f"not {value!r}", hint="8 keeps about 0.53 of a 16-bit cache's "
                          "bytes, 4 about 0.28 (less accurate); leave it out for full "
                          "precision")
    if key == "kv_group_size" and not (whole and value in KV_GROUP_SIZES):
        raise ConfigError(f"{what} must be one of {', '.join(map(str, KV_GROUP_SIZES))} "
                          f"(elements per scale and bias, mlx's group sizes), not {value!r}",
                          hint=f"leave it out for {DEFAULT_KV_GROUP_SIZE}, mlx-lm's default")
    if key == "quantized_kv_start" and not (whole and isinstance(value, int)
                                            and 0 <= value < 2**31):
        raise ConfigError(f"{what} must be a number of tokens, 0 or more, not {value!r}",
                          hint="0 (the default) quantizes from the first token; mlx-lm's "
                          "command line waits for 5000")


def check_kv_setting(kv: KVQuant | None, origin: str, *, node_role: str) -> None:
    """``kv_bits`` only where a model runs: not on a router over replicas."""
    if kv is not None and node_role == ROUTER_ROLE:
        raise ConfigError(f"{origin} {kv.bits} with node_role router (--node-role): a router "
                          "over replicas holds no model, and so no KV cache",
                          hint="set kv_bits on the replicas that hold the model")


def check_kv_model(model: str | None, kv: KVQuant | None, origin: str) -> None:
    """The model (a local directory; a repo id is judged where it is loaded) can keep
    ``kv``'s cache, judged from its config.json (``models/kvquant.py``)."""
    if model is None or kv is None or not Path(model).is_dir():
        return
    try:
        config = read_model_config(Path(model))
    except ConfigError:
        return  # the model's own load names what is wrong with it
    check_kv_quant(config, kv, source=str(Path(model) / "config.json"), what=origin)


def kv_origin(flag: int | None, where: str) -> str:
    """Where ``kv_bits`` was said, for messages: the flag, or the file's key."""
    return FLAGS["kv_bits"] if flag is not None else f"{where}: 'serve.kv_bits'"
