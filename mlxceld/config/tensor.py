"""Tensor parallelism inside one host: ``--tp-size N`` (``[serve] tp_size``).

``[serve]`` in the config file (the flag wins)::

    [serve]
    tp_size = 2                     # 1 (default) .. 16: ranks splitting each layer

On a pipeline's stage host (``--pp-peer``, or a stage node of a ``--distributed-config``
pipeline TOML), the stage is the group instead: the ``stage`` worker is rank 0 and
``stage-tp-1`` .. ``stage-tp-{N-1}`` the other ranks, each holding its slice of the
stage's layers (``pipeline/tensor_stage.py``).

With ``tp_size`` N above 1, the model is split over N processes of this host that
run as one ``mlx.distributed`` group (a ring over 127.0.0.1): the router worker is
rank 0 (the OpenAI port, the API, batching) and N-1 workers ``tp-1`` .. ``tp-{N-1}``
are ranks 1 .. N-1. Each rank holds about 1/N of the layers' weights (mlx-lm's own
``Model.shard``) plus the embedding and head. The supervisor restarts the N
processes together when any of them ends. A serving cluster TOML says it as
``[cluster] tensor_parallel_size`` (each hybrid node's ``tp_size``); a cluster TOML of
``tensor_parallel_rank`` nodes says a group across hosts (below) the same way
(``cluster/clusterfile/placement.py``).

Refused at start (exit 2, naming the flag or key and the reason), and on a SIGHUP
reload (the running config is kept) — ``check_tp_setting``:

- beside ``--node-role router`` (no model here), ``prefill`` or ``decode`` (not built
  yet), ``--pp-auto`` or a pipeline TOML's coordinator node (its router holds no layers:
  set tp_size on the stage hosts), or ``--tp-peers`` beside a pipeline other than
  ``--pp-peer`` (a pipeline TOML's stage group across hosts is said by the file: its
  ``pipeline_tensor_parallel`` nodes, the 2D mesh, ``cluster/clusterfile/mesh.py``);
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

from mlxceld.config.peers import agent_peers
from mlxceld.errors import ConfigError
from mlxceld.models.tensor import MAX_TP_SIZE, TensorParallelRefused, check_model_dir
from mlxceld.types import HANDOFF_SIDES, HYBRID, ROUTER_ROLE, TENSOR_RANK_ROLE

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


STAGE_HINT: Final = ("set tp_size on the stage hosts instead (--tp-size 2 beside --pp-peer, "
                     "or [serve] tp_size on a cluster TOML's stage node): each runs its "
                     "stage as a tensor-parallel group of its own")


def check_tp_setting(tp_size: int, origin: str, *, node_role: str,
                     pipeline: str | None, peers: tuple[str, ...] = ()) -> None:
    """``tp_size`` above 1 only on a hybrid node: on the model alone, or as a pipeline's
    stage host (``--pp-peer``: its stage a group on this host, or across hosts with
    ``peers``); never on a coordinator (``pipeline`` ``pp_auto (--pp-auto)``: its router
    holds no layers), and a group across hosts (``peers``) beside no other pipeline.
    ``pipeline`` names the pipeline setting in force, if any (a cluster TOML's node is
    judged by ``check_tp_node``)."""
    if tp_size == 1:
        return
    said = f"{origin} {tp_size}"
    if node_role == ROUTER_ROLE:
        raise ConfigError(f"{said} with node_role router (--node-role): a router over "
                          "replicas holds no model here to split",
                          hint="set tp_size on the hybrid nodes that hold the model; "
                          + TP_HINT)
    if node_role == TENSOR_RANK_ROLE:
        return  # check_tp_peers says why
    if node_role in HANDOFF_SIDES:
        raise ConfigError(f"{said} with node_role {node_role} (--node-role): tensor "
                          f"parallelism on a {node_role} node is not built yet",
                          hint=TP_HINT)
    if pipeline is None:
        return
    if peers and not pipeline.startswith("pp_peer"):
        raise ConfigError(f"{said} with {PEERS_FLAG} and {pipeline}: a pipeline stage whose "
                          "tensor-parallel group spans hosts is built for a --pp-peer stage "
                          "host only",
                          hint=f"give {PEERS_FLAG} beside --pp-peer on the stage host, or "
                          f"drop {PEERS_FLAG}: a stage host's group then runs on that host "
                          "(--tp-size alone); a cluster TOML says a stage's group across "
                          "hosts with pipeline_tensor_parallel nodes (the 2D mesh)")
    if pipeline.startswith("pp_auto"):
        raise ConfigError(f"{said} with {pipeline}: the coordinator's router holds no "
                          "layers of the pipeline to split", hint=STAGE_HINT)


def check_tp_node(tp_size: int, origin: str, node: str, role: str, path: object) -> None:
    """``tp_size`` above 1 beside ``--distributed-config``'s pipeline TOML (``path``) only
    on a stage node (``node``, of ``role``): its coordinator's router holds no layers."""
    if tp_size > 1 and role == "coordinator":
        raise ConfigError(f"{origin} {tp_size} with distributed_config "
                          f"(--distributed-config) {path}: node {node!r} is the pipeline's "
                          "coordinator, whose router holds no layers to split",
                          hint=STAGE_HINT)


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


# -- a group across hosts: --tp-peers and --node-role tensor_parallel_rank ----------------

PEERS_FLAG: Final = "--tp-peers"
PEERS_KEY: Final = "tp_peers"
PEERS_HINT: Final = ("name the agents of the hosts that run ranks 1 .. N-1, in rank order: "
                     "--tp-size 2 --tp-peers 192.168.1.11 (a host alone: port 19000), each "
                     "started with --node-role tensor_parallel_rank, the same model and the "
                     "same cluster secret")


def parse_tp_peers(flag: str | None, table: Mapping[str, Any],
                   where: str) -> tuple[tuple[str, ...], str]:
    """``--tp-peers`` (it wins) or ``[serve] tp_peers``: the agent addresses of the hosts of
    ranks 1 .. N-1 in rank order (numeric or names, port 19000 when left out), and where
    they were said."""
    value: object
    if flag is not None:
        value, what = flag, PEERS_FLAG
    else:
        value, what = table.get(PEERS_KEY, []), f"{where}: 'serve.{PEERS_KEY}'"
        if not isinstance(value, list):
            raise ConfigError(f"{what} must be a list of agent addresses, not {value!r}",
                              hint='for example tp_peers = ["192.168.1.11"]')
    assert isinstance(value, str | list)
    return agent_peers(value, what, hint=PEERS_HINT), what


def check_tp_peers(tp_size: int, size_from: str, peers: tuple[str, ...], peers_from: str, *,
                   node_role: str, model: str | None) -> None:
    """A group across hosts is said whole: rank 0 (a hybrid node) names one peer per rank
    past its own (``tp_size`` = peers + 1); a rank host (``tensor_parallel_rank``) names
    the model and neither setting (its rank, the ring and the batch come from rank 0)."""
    if node_role == TENSOR_RANK_ROLE:
        if peers or tp_size != 1:
            said = peers_from if peers else f"{size_from} {tp_size}"
            raise ConfigError(f"{said} with node_role {TENSOR_RANK_ROLE} (--node-role): a "
                              "rank host takes its rank and group from rank 0's daemon",
                              hint="give --tp-size and --tp-peers to rank 0's daemon only")
        if model is None:
            raise ConfigError(f"node_role {TENSOR_RANK_ROLE} (--node-role) needs the model "
                              "(--model or [serve] model): the same one rank 0 serves",
                              hint=PEERS_HINT)
        return
    if not peers:
        return
    if node_role != HYBRID:
        raise ConfigError(f"{peers_from} with node_role {node_role} (--node-role): rank 0 "
                          "of a group across hosts is a hybrid node that holds the model",
                          hint=PEERS_HINT)
    if tp_size != len(peers) + 1:
        raise ConfigError(f"{peers_from} names {len(peers)} rank host(s) and {size_from} is "
                          f"{tp_size}: the group is this host (rank 0) and one host per "
                          f"rank past it, so {size_from} must be {len(peers) + 1}",
                          hint=PEERS_HINT)


def across_hosts(node_role: str, peers: tuple[str, ...]) -> str | None:
    """The setting that makes this daemon part of a tensor-parallel group across hosts
    (which needs the cluster secret), or None."""
    if node_role == TENSOR_RANK_ROLE:
        return f"--node-role {TENSOR_RANK_ROLE}"
    return PEERS_FLAG if peers else None


def check_tp_reload(old_peers: tuple[str, ...], old_role: str, new_peers: tuple[str, ...],
                    new_role: str) -> None:
    """A reload keeps a group across hosts as it started: ``tp_peers`` and the
    ``tensor_parallel_rank`` role are read at start only (``ConfigError`` otherwise, the
    running config kept)."""
    if old_peers != new_peers or (old_role != new_role
                                  and TENSOR_RANK_ROLE in (old_role, new_role)):
        raise ConfigError("a reload cannot change serve.tp_peers (--tp-peers) or a node_role "
                          f"of {TENSOR_RANK_ROLE}: a group across hosts keeps the peers and "
                          "roles it started with",
                          hint="restart the daemon to apply them")
