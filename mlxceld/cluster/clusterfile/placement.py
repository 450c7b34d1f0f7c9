"""This daemon's place in a cluster TOML, and the worker it runs there.

``place(path, node_id)`` reads and checks the cluster config, finds the node,
takes the model (``--model`` or the file's ``model``: a directory, or a Hugging
Face repo id whose config, index and tokenizer it fetches, ``models/fetch.py``),
checks that the model is of a family mlxceld splits (``models.families``), checks
the stages' layer ranges against the model's layer count and computes the model
identity, all before anything starts. A coordinator runs the router
with the pipeline engine; a pipeline stage runs the ``stage`` worker. The
worker options built here are all the worker knows of the cluster.

A serving cluster's node (role router, hybrid, prefill or decode) has no placement:
``placed_config`` turns the file into the ``Config`` the equivalent flags give
(``--node-role``, ``--replicas``, ``--prefill-peers``, ``--decode-peers``,
``--kv-compression``, ``--model``; the file's ``name`` as ``--cluster-name``; its
``address`` as ``--agent-addr`` unless that is given; on a hybrid node, the file's
``tensor_parallel_size`` as ``--tp-size``), and from there the daemon runs as with those
flags. So does a rank of a tensor-parallel group across hosts (role
``tensor_parallel_rank``): rank 0 as ``--tp-size N --tp-peers`` the other ranks' agent
addresses in rank order (its router is rank 0 and serves the OpenAI port), every other
rank as ``--node-role tensor_parallel_rank``; each checks that the model splits over N.
A flag or ``[serve]`` key that says otherwise is refused naming both. A router
holds no model: ``--tp-size`` above 1 there is refused naming the node. Beside a
pipeline's file, ``--tp-size`` above 1 makes a stage node's stage a tensor-parallel group
on its host; on the coordinator node (its router holds no layers), or with
``--tp-peers`` (a stage's group across hosts is not built yet), it is refused
(``serving_config``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from mlxceld.cluster.clusterfile.load import (
    ClusterConfig,
    NodeConfig,
    load_cluster,
    needs_secret,
    select_node,
    validate_layers,
)
from mlxceld.config.daemon import DEFAULT_AGENT_ADDR, Config, Overrides
from mlxceld.config.serve import ServeConfig, resolve_model
from mlxceld.config.tensor import check_tp_model, check_tp_node, check_tp_setting, tp_origin
from mlxceld.errors import ConfigError
from mlxceld.models.families import check_family
from mlxceld.models.fetch import is_repo_id, local_model
from mlxceld.models.identity import layer_count, model_identity, read_model_config
from mlxceld.roles import STAGE
from mlxceld.roles.options import (
    DEFAULT_DRAFT_TOKENS,
    PipelineOptions,
    PipelineStage,
    StageOptions,
)
from mlxceld.types import (
    DECODE_ROLE,
    DEFAULT_SILENCE_S,
    HYBRID,
    PREFILL_ROLE,
    ROUTER_ROLE,
    TENSOR_RANK_ROLE,
)

STAGE_WORKER: Final = STAGE  # the worker's name and role on a stage node
# A tensor-parallel stage's group: the stage worker (rank 0) and its ``stage-tp-<r>`` ranks.
STAGE_TP_GROUP: Final = "stage-tp"


@dataclass(frozen=True)
class Placement:
    cluster: ClusterConfig
    node: NodeConfig
    model: Path
    model_identity: str

    @property
    def is_coordinator(self) -> bool:
        return self.node.role == "coordinator"

    @property
    def needs_secret(self) -> bool:
        return needs_secret(self.cluster)

    def describe(self) -> dict[str, Any]:
        return {"name": self.cluster.name, "file": str(self.cluster.path),
                "node": self.node.id, "role": self.node.role, "address": self.node.address,
                "layers": list(self.node.layers) if self.node.layers else None,
                "stages": len(self.cluster.stages), "replicas": self.cluster.replicas,
                "model": str(self.model),
                "model_identity": self.model_identity}


def place(path: Path, node_id: str, model_override: str | None = None) -> Placement:
    """Everything a daemon needs to run ``node_id`` of the cluster TOML at ``path``."""
    cfg = load_cluster(path)
    node = select_node(cfg, node_id)
    name = model_override or cfg.model_source()
    if name is not None and not Path(name).expanduser().exists() and is_repo_id(name):
        model: Path | None = local_model(name)  # a repo id: its metadata (models/fetch.py)
    else:
        model = Path(model_override).expanduser().absolute() if model_override \
            else cfg.model_path()
    if model is None:
        raise ConfigError(f"{path}: [cluster] has no 'model' and --model was not given",
                          hint="set model = \"DIR\" under [cluster] (relative to the file) "
                          "or pass --model DIR")
    config, source = read_model_config(model), str(model / "config.json")
    check_family(config, f"{path}: {source}")  # UnsupportedFamily, before anything loads
    validate_layers(cfg, layer_count(config, source=source))
    return Placement(cfg, node, model, model_identity(model))


def stage_options(p: Placement, *, standby: bool = False,
                  silence_s: float = DEFAULT_SILENCE_S) -> StageOptions:
    """The ``stage`` worker's options for this node (``standby``: a prepared assignment's,
    loaded and not serving until activated; ``silence_s``: its links' heartbeat bound)."""
    cfg, node = p.cluster, p.node
    assert node.layers is not None and node.rank is not None
    stages = cfg.group_of(node.id)  # its neighbours are those of its own replica
    up = stages[node.rank - 1] if node.rank > 0 else None
    down = stages[node.rank + 1] if node.rank + 1 < len(stages) else None
    ring = len(stages) > 1  # the last stage sends each continuing token to the first
    return StageOptions(
        model=str(p.model), layers=node.layers, node_id=node.id, rank=node.rank,
        address=node.address, coordinator=cfg.coordinator.address,
        upstream=up.address if up else None, downstream=down.address if down else None,
        first=stages[0].address if ring and node.rank == len(stages) - 1 else None,
        last=stages[-1].address if ring and node.rank == 0 else None,
        model_identity=p.model_identity, cluster=cfg.name, standby=standby,
        silence_s=silence_s,
        # each group's last stage runs the draft (pipeline/speculating.py)
        draft_model=cfg.draft_source() if down is None else None,
        num_draft_tokens=cfg.num_draft_tokens or DEFAULT_DRAFT_TOKENS)


def pipeline_options(p: Placement) -> PipelineOptions:
    """The router's ``pipeline`` option: the stages to drive (replica 0's) and who we
    are."""
    return group_options(p, 0)


def replica_pipelines(p: Placement) -> tuple[PipelineOptions, ...]:
    """The router's ``replica_pipelines``: replica 1's stages, replica 2's, ... (empty
    with one replica)."""
    return tuple(group_options(p, i) for i in range(1, p.cluster.replicas))


def group_options(p: Placement, replica: int) -> PipelineOptions:
    """Replica group ``replica``'s stages as a ``PipelineOptions``."""
    stages = []
    for s in p.cluster.groups[replica]:
        assert s.rank is not None and s.layers is not None  # a stage node has both
        stages.append(PipelineStage(node_id=s.id, address=s.address, rank=s.rank,
                                    layers=s.layers))
    return PipelineOptions(stages=tuple(stages), coordinator=p.node.address,
                           model_identity=p.model_identity, cluster=p.cluster.name)


def placed_config(config: Config, cfg: ClusterConfig, node: NodeConfig,
                  flags: Overrides) -> Config:
    """``config`` with the ``[serve]`` values (and cluster name and agent address) that the
    serving cluster or tensor-parallel group ``cfg`` gives its ``node``: what the equivalent
    flags would give."""
    assert node.is_serving or node.is_tensor_rank
    where = f"{cfg.path}: node {node.id!r}"
    serve = config.serve
    own = _tensor_values(cfg, node) if node.is_tensor_rank else _serve_values(cfg, node)
    _refuse_contradictions(serve, own, flags, where, node)
    model = serve.model
    if model is None:
        source = cfg.model_source()
        if source is None:
            raise ConfigError(f"{cfg.path}: [cluster] has no 'model' and --model was not "
                              "given", hint="set model = \"DIR\" under [cluster] (relative "
                              "to the file) or pass --model DIR")
        model = resolve_model(source, cfg.path.parent, f"{cfg.path}: 'cluster.model'")
    serve = replace(serve, model=model, **own)
    split = cfg.tensor_parallel_size if node.is_tensor_rank else serve.tp_size
    check_tp_model(model, split, f"{cfg.path}: 'cluster.model' with "
                   f"'cluster.tensor_parallel_size' {split}")
    if flags.cluster_name is not None and flags.cluster_name != cfg.name:
        raise ConfigError(f"--cluster-name {flags.cluster_name!r} contradicts {cfg.path}'s "
                          f"name {cfg.name!r}", hint="drop --cluster-name: the file names "
                          "the cluster")
    agent = node.address if config.agent_addr == DEFAULT_AGENT_ADDR else config.agent_addr
    return replace(config, serve=serve, cluster_name=cfg.name, agent_addr=agent)


def _serve_values(cfg: ClusterConfig, node: NodeConfig) -> dict[str, Any]:
    """``[serve]``'s node_role, replicas, prefill_peers, decode_peers and kv_compression of
    ``node``, as config/replicas.py and config/disagg.py would read them."""
    addresses = {role: tuple(n.address for n in cfg.with_role(role))
                 for role in (HYBRID, PREFILL_ROLE, DECODE_ROLE)}
    values: dict[str, Any] = {"node_role": node.role, "replicas": (), "prefill_peers": (),
                              "decode_peers": (), "kv_compression": "none",
                              "tp_size": cfg.tensor_parallel_size if node.role == HYBRID
                              else 1}
    if node.role == ROUTER_ROLE:
        values.update(replicas=addresses[HYBRID], prefill_peers=addresses[PREFILL_ROLE],
                      decode_peers=addresses[DECODE_ROLE],
                      kv_compression=cfg.kv_compression or "none")
    elif node.role == DECODE_ROLE:
        values.update(prefill_peers=addresses[PREFILL_ROLE])
    return values


def _tensor_values(cfg: ClusterConfig, node: NodeConfig) -> dict[str, Any]:
    """A tensor-parallel rank's ``[serve]`` values, as config/tensor.py would read the flags:
    rank 0 a hybrid with ``tp_size`` N and ``tp_peers`` the other ranks' agent addresses in
    rank order; every other rank ``node_role`` tensor_parallel_rank (its rank, the ring and
    the batch come from rank 0's daemon, as with the flags)."""
    values: dict[str, Any] = {"replicas": (), "prefill_peers": (), "decode_peers": (),
                              "kv_compression": "none"}
    if node.rank == 0:
        peers = tuple(n.address for n in cfg.tensor_ranks[1:])
        return {**values, "node_role": HYBRID, "tp_size": cfg.tensor_parallel_size,
                "tp_peers": peers}
    return {**values, "node_role": TENSOR_RANK_ROLE, "tp_size": 1, "tp_peers": ()}


# tp_peers is said by the file for a tensor-parallel rank only: a serving cluster's hybrid
# may still be rank 0 of a group whose --tp-peers are given as flags.
_FLAGS: Final = {"node_role": "--node-role", "replicas": "--replicas",
                 "prefill_peers": "--prefill-peers", "decode_peers": "--decode-peers",
                 "kv_compression": "--kv-compression", "tp_size": "--tp-size",
                 "tp_peers": "--tp-peers"}


def _refuse_contradictions(serve: ServeConfig, own: dict[str, Any], flags: Overrides,
                           where: str, node: NodeConfig) -> None:
    """A flag or [serve] key among ``_FLAGS`` (of those ``own`` says) beside the file:
    refused unless it says what the file says (the file places the node; two sources
    would drift apart)."""
    defaults = ServeConfig()
    for key, flag in _FLAGS.items():
        if key not in own:
            continue
        given = getattr(flags, key) is not None
        value = getattr(serve, key)
        if not given and value == getattr(defaults, key):
            continue  # neither the flag nor the [serve] key said anything
        if value != own[key]:
            said = flag if given else f"[serve] {key}"
            if key == "tp_size":
                _refuse_tp(said, value, own, where, node)
            raise ConfigError(f"{said} ({_shown(value)}) contradicts --distributed-config: "
                              f"{where} says {key} = {_shown(own[key])}",
                              hint=f"drop {said}: the cluster TOML places this node")


def _refuse_tp(said: str, tp_size: int, own: dict[str, Any], where: str,
               node: NodeConfig) -> None:
    """``--tp-size`` (``said``: or [serve] tp_size) beside a cluster file that gives this
    node another: refused, naming why."""
    role = own["node_role"]
    size = "'cluster.tensor_parallel_size'"
    why = (f"{where} is rank 0 of the file's tensor-parallel group, whose {size} is "
           f"{own['tp_size']}" if node.is_tensor_rank and node.rank == 0 else
           f"{where} is rank {node.rank} of the file's tensor-parallel group, which takes its "
           f"size from rank 0's daemon" if node.is_tensor_rank else
           f"{where} is a hybrid node, and the file's 'cluster.tensor_parallel_size' is "
           f"{own['tp_size']}" if role == HYBRID else
           f"{where} is a router, which holds no model to split over ranks" if role == ROUTER_ROLE
           else f"{where} is a {role} node, where tensor parallelism is not built yet")
    raise ConfigError(f"{said} {tp_size} contradicts --distributed-config: {why}",
                      hint=f"drop {said}: the cluster TOML's tensor_parallel_size (under "
                      "[cluster]) sets it on " + ("rank 0" if node.is_tensor_rank
                                                  else "its hybrid nodes"))


def _shown(value: object) -> str:
    return ", ".join(value) or "none" if isinstance(value, tuple) else str(value)


def serving_cluster(config: Config) -> ClusterConfig | None:
    """The serving cluster (routers, hybrids, prefill and decode nodes) or tensor-parallel
    group across hosts that ``--distributed-config`` names, or None (no file, or a
    pipeline's: ``place``'s)."""
    if config.distributed_config is None:
        return None
    cfg = load_cluster(config.distributed_config)
    return cfg if cfg.serving or cfg.tensor else None


def served_node(cfg: ClusterConfig, node_id: str) -> str:
    """``FILE: node 'ID' (ROLE)`` (``ROLE, rank R`` for a tensor-parallel rank): the node
    of a serving cluster or group that this daemon runs, for messages."""
    node = select_node(cfg, node_id)
    rank = f", rank {node.rank}" if node.is_tensor_rank else ""
    return f"{cfg.path}: node {node.id!r} ({node.role}{rank})"


def serving_config(config: Config, flags: Overrides) -> Config:
    """``config`` as ``placed_config`` makes it when ``--distributed-config`` names a
    serving cluster's or tensor-parallel group's node; else ``config`` unchanged."""
    cfg = serving_cluster(config)
    if cfg is None:
        if config.distributed_config is not None and config.serve.tp_size > 1:
            said = tp_origin(flags.tp_size, str(config.config_file or "config"))
            pipeline = load_cluster(config.distributed_config)
            node = select_node(pipeline, config.node_id or "")
            check_tp_node(config.serve.tp_size, said, node.id, node.role, pipeline.path)
            check_tp_setting(config.serve.tp_size, said, node_role=config.serve.node_role,
                             pipeline="distributed_config (--distributed-config)",
                             peers=config.serve.tp_peers)
        return config
    return placed_config(config, cfg, select_node(cfg, config.node_id or ""), flags)
