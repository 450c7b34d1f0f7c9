"""``--tp-moe-mode``, ``--tp-embedding-mode``, ``--tp-lm-head-mode``: replicate or shard.

``[serve]`` in the config file (each flag wins over its key)::

    [serve]
    tp_size = 2
    tp_moe_mode = "shard"           # experts cut across the ranks (mlx-lm's split)
    tp_embedding_mode = "replicate" # the token embedding whole on every rank
    tp_lm_head_mode = "replicate"   # the head: as mlx-lm splits this model's family

Each says what a tensor-parallel group does with one part of the model, and mlxceld
does what mlx-lm's ``Model.shard`` does (``models/tensor_modes.py`` tells which, part by
part). A setting that names that is honoured; one that names the other is refused at
start and on a reload (exit 2, naming the flag or key, its value and why), as are:

- a value other than ``replicate`` or ``shard``;
- any of them without ``tp_size`` above 1 (no group: nothing is split);
- ``tp_lm_head_mode`` against the model's family (judged from config.json, where the
  model is a local directory, else once a repo id's config is fetched, like
  ``tp_size``'s own check).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.models.tensor import TensorParallelRefused
from mlxceld.models.tensor_modes import (
    MODES,
    PARTS,
    Mode,
    Part,
    TensorModes,
    check_modes,
    fixed_refusal,
)

FLAGS: Final[dict[Part, str]] = {"moe": "--tp-moe-mode", "embedding": "--tp-embedding-mode",
                                 "lm_head": "--tp-lm-head-mode"}
KEYS: Final[dict[Part, str]] = {part: f"tp_{part}_mode" for part in PARTS}
MODE_HINT: Final = ("leave the mode out: mlxceld splits with mlx-lm's own rule "
                    "(experts and layers cut, embedding whole, the head as the family's)")


def mode_names(flags: Mapping[Part, str | None], where: str) -> dict[Part, str]:
    """Each part's setting as said: its flag when given, else the file's key."""
    return {part: FLAGS[part] if flags.get(part) is not None
            else f"{where}: 'serve.{KEYS[part]}'" for part in PARTS}


def setting_names() -> dict[Part, str]:
    """Each part's setting by key and flag, for checks after start (``mlxctl serve``)."""
    return {part: f"{KEYS[part]} ({FLAGS[part]})" for part in PARTS}


def parse_tp_modes(flags: Mapping[Part, str | None], table: Mapping[str, Any],
                   where: str) -> TensorModes:
    """The three modes from their flags (they win) or ``[serve]``'s keys; a value other
    than replicate or shard, or one mlx-lm's split never gives, is refused by name."""
    names = mode_names(flags, where)
    found: dict[Part, Mode] = {}
    for part in PARTS:
        flag = flags.get(part)
        value: object = flag if flag is not None else table.get(KEYS[part])
        if value is None:
            continue
        if value not in MODES:
            raise ConfigError(f"{names[part]} must be replicate or shard, not {value!r}",
                              hint=MODE_HINT)
        mode: Mode = "shard" if value == "shard" else "replicate"
        why = fixed_refusal(part, mode)
        if why is not None:
            raise ConfigError(f"{names[part]} {mode}: {why}", hint=MODE_HINT)
        found[part] = mode
    return TensorModes(**found)


def check_tp_modes(modes: TensorModes, tp_size: int, names: Mapping[Part, str]) -> None:
    """A mode said needs a group: ``tp_size`` above 1."""
    for part, mode in modes.said().items():
        if tp_size <= 1:
            raise ConfigError(f"{names[part]} {mode} without a tensor-parallel group "
                              "(tp_size is 1): there is nothing to split",
                              hint="give --tp-size 2 or more ([serve] tp_size), or leave "
                              f"{names[part]} out")


def check_tp_modes_model(model: str | None, modes: TensorModes,
                         names: Mapping[Part, str], what: str) -> None:
    """The modes against the model (``what`` names where it was said), when it is a local
    directory with a readable config.json; else judged where the model is loaded."""
    if model is None or not modes.said() or not Path(model).is_dir():
        return
    config = read_config(Path(model))
    if config is None:
        return
    try:
        check_modes(config, modes, source=f"{what} ({model})", names=names)
    except TensorParallelRefused as exc:
        raise ConfigError(str(exc), hint=MODE_HINT) from None


def read_config(model: Path) -> Mapping[str, Any] | None:
    """``model/config.json`` as an object, or None where it cannot be had (the model's own
    checks say why where it is loaded)."""
    try:
        config = json.loads((model / "config.json").read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None
