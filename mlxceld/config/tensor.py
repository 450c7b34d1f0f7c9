"""Tensor parallelism inside one host: ``--tp-size N`` (``[serve] tp_size``).

``[serve]`` in the config file (the flag wins)::

    [serve]
    tp_size = 2                     # 1 (default) .. 16: ranks splitting each layer

With ``tp_size`` N above 1, the model is split over N processes of this host that
run as one ``mlx.distributed`` group (a ring over 127.0.0.1): the router worker is
rank 0 (the OpenAI port, the API, batching) and N-1 workers ``tp-1`` .. ``tp-{N-1}``
are ranks 1 .. N-1. Each rank holds about 1/N of the layers' weights (mlx-lm's own
``Model.shard``) plus the embedding and head. The supervisor restarts the N
processes together when any of them ends. A serving cluster TOML says it as
``[cluster] tensor_parallel_size`` (each hybrid node's ``tp_size``).

Refused at start (exit 2, naming the flag or key and the reason), and on a SIGHUP
reload (the running config is kept) — ``check_tp_setting``:

- beside ``--node-role router`` (no model here), ``prefill`` or ``decode`` (not built
  yet), ``--pp-peer``, ``--pp-auto``, or a pipeline's ``--distributed-config``
  (tensor parallelism inside a pipeline stage is not built);
- a model of a family mlx-lm cannot shard, or whose attention heads, KV heads or MLP
  sizes N does not divide (``models/tensor.py``): checked from config.json when the
  model is a local directory (``check_tp_model``); a Hugging Face repo id is checked the
  same way once the daemon has fetched its config (at start).
  ``mlxctl serve`` of such a model is refused too, changing nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.models.tensor import MAX_TP_SIZE, TensorParallelRefused, check_model_dir
from mlxceld.types import HANDOFF_SIDES, ROUTER_ROLE

FLAG: Final = "--tp-size"
KEY: Final = "tp_size"
TP_HINT: Final = ("leave --tp-size out (or [serve] tp_size = 1) to run the model in one "
                  "process; tensor parallelism runs on a hybrid node that holds the model")


def parse_tp_size(flag: int | None, table: Mapping[str, Any], where: str) -> int:
    """``--tp-size`` (it wins) or ``[serve] tp_size``: a whole number 1..MAX_TP_SIZE."""
    value: object = flag if flag is not None else table.get(KEY, 1)
    what = FLAG if flag is not None else f"{where}: 'serve.{KEY}'"
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TP_SIZE:
        raise ConfigError(f"{what} must be a whole number from 1 to {MAX_TP_SIZE} (the ranks "
                          f"that split each layer), not {value!r}",
                          hint="for example --tp-size 2 (or tp_size = 2 under [serve]); "
                          "1 runs the model in one process")
    return value


def tp_origin(flag: int | None, where: str) -> str:
    """Where ``tp_size`` was said, for messages: the flag, or the file's key."""
    return FLAG if flag is not None else f"{where}: 'serve.{KEY}'"


def check_tp_setting(tp_size: int, origin: str, *, node_role: str,
                     pipeline: str | None) -> None:
    """``tp_size`` above 1 only on a hybrid node with no pipeline of its own: ``pipeline``
    names the pipeline setting in force (``pp_auto (--pp-auto)`` ...), if any."""
    if tp_size == 1:
        return
    said = f"{origin} {tp_size}"
    if node_role == ROUTER_ROLE:
        raise ConfigError(f"{said} with node_role router (--node-role): a router over "
                          "replicas holds no model here to split",
                          hint="set tp_size on the hybrid nodes that hold the model; "
                          + TP_HINT)
    if node_role in HANDOFF_SIDES:
        raise ConfigError(f"{said} with node_role {node_role} (--node-role): tensor "
                          f"parallelism on a {node_role} node is not built yet",
                          hint=TP_HINT)
    if pipeline is not None:
        raise ConfigError(f"{said} with {pipeline}: tensor parallelism inside a pipeline "
                          "stage is not built yet", hint="drop one of them; " + TP_HINT)


def check_tp_model(model: str | None, tp_size: int, what: str) -> None:
    """The model (``what`` names where it was said) splits over ``tp_size`` ranks, when it
    is a local directory (``ConfigError`` naming why and the sizes that work); a repo id
    not fetched yet is not judged here."""
    if model is None or tp_size == 1 or not Path(model).is_dir():
        return
    try:
        check_model_dir(Path(model), tp_size)
    except FileNotFoundError:
        return  # no config.json: the model's own check says so where it is loaded
    except TensorParallelRefused as exc:
        raise ConfigError(f"{what}: {exc}", hint="give a tp size that splits this model, or "
                          "leave --tp-size out ([serve] tp_size = 1) to run it in one "
                          "process") from None
