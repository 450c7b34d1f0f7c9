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
``--tp-peers`` (a stage's group across hosts is the 2D mesh's file), it is refused
(``serving_config``).

A 2D mesh's file (``pipeline_tensor_parallel`` nodes, ``mesh.py``): its coordinator is
placed as a pipeline's; a stage's rank 0 as a pipeline stage whose group spans hosts
(``Placement.tp_peers``: its stage's other ranks' agent addresses in rank order; the
stage host forms it as ``--pp-peer --tp-size T --tp-peers`` does, ``daemon/stage_peers.py``),
every other rank as ``--node-role tensor_parallel_rank`` (``placed_config``); each
checks that the model splits over T. ``--tp-size`` or ``--tp-peers`` that says
otherwise is refused naming both.
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
from mlxceld.config.tensor import (
    PEERS_FLAG,
    check_tp_model,
    check_tp_node,
    check_tp_setting,
    tp_origin,
)
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
    # A 2D mesh's stage (its rank 0 here): the agent addresses of its ranks 1 .. T-1 in
    # rank order, the group across hosts; () for any other placement.
    tp_peers: tuple[str, ...] = ()

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
    peers: tuple[str, ...] = ()
    if cfg.mesh:  # every stage splits over T: refused before anything loads
        check_tp_model(str(model), cfg.tensor_parallel_size, f"{path}: 'cluster.model' with "
                       f"'cluster.tensor_parallel_size' {cfg.tensor_parallel_size}")
        if node.is_stage:  # rank 0 (a rank past 0 is placed_config's: a rank host)
            peers = tuple(n.address for n in cfg.stage_ranks(node.id)[1:])
    return Placement(cfg, node, model, model_identity(model), peers)


def stage_options(p: Placement, *, standby: bool = False,
                  silence_s: float = DEFAULT_SILENCE_S) -> StageOptions:
    """The ``stage`` worker's options for this node (``standby``: a prepared assignment's,
    loaded and not serving until activated; ``silence_s``: its links' heartbeat bound)."""
    cfg, node = p.cluster, p.node
    assert node.layers is not None and node.rank is not None
    stages = cfg.group_of(node.id)  # its neighbours are those of its own replica
    rank = [s.id for s in stages].index(node.id)  # a 2D mesh's rank is its tensor rank
    up = stages[rank - 1] if rank > 0 else None
    down = stages[rank + 1] if rank + 1 < len(stages) else None
    ring = len(stages) > 1  # the last stage sends each continuing token to the first
    return StageOptions(
        model=str(p.model), layers=node.layers, node_id=node.id, rank=rank,
        address=node.address, coordinator=cfg.coordinator.address,
        upstream=up.address if up else None, downstream=down.address if down else None,
        first=stages[0].address if ring and rank == len(stages) - 1 else None,
        last=stages[-1].address if ring and rank == 0 else None,
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
    for rank, s in enumerate(p.cluster.groups[replica]):  # in rank (a mesh: layers) order
        assert s.layers is not None  # a stage node has its layers
        stages.append(PipelineStage(node_id=s.id, address=s.address, rank=rank,
                                    layers=s.layers))
    return PipelineOptions(stages=tuple(stages), coordinator=p.node.address,
                           model_identity=p.model_identity, cluster=p.cluster.name)


def placed_config(config: Config, cfg: ClusterConfig, node: NodeConfig,
                  flags: Overrides) -> Config:
    """``config`` with the ``[serve]`` values (and cluster name and agent address) that the
    serving cluster or tensor-parallel group ``cfg`` gives its ``node``: what the equivalent
    flags would give (a 2D mesh's rank past 0: a rank host's)."""
    ranked = node.is_tensor_rank or node.is_mesh
    assert node.is_serving or ranked
    where = f"{cfg.path}: node {node.id!r}"
    serve = config.serve
    own = _tensor_values(cfg, node) if ranked else _serve_values(cfg, node)
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
    split = cfg.tensor_parallel_size if ranked else serve.tp_size
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
    if node.rank == 0 and node.is_tensor_rank:  # a 2D mesh's rank 0 is placed (``place``)
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
           f"{where} is rank {node.rank} of a stage's tensor-parallel group, which takes its "
           f"size from the stage's rank 0" if node.is_mesh else
           f"{where} is a hybrid node, and the file's 'cluster.tensor_parallel_size' is "
           f"{own['tp_size']}" if role == HYBRID else
           f"{where} is a router, which holds no model to split over ranks" if role == ROUTER_ROLE
           else f"{where} is a {role} node, where tensor parallelism is not built yet")
    raise ConfigError(f"{said} {tp_size} contradicts --distributed-config: {why}",
                      hint=f"drop {said}: the cluster TOML's tensor_parallel_size (under "
                      "[cluster]) sets it on " + ("rank 0" if node.is_tensor_rank or node.is_mesh
                                                  else "its hybrid nodes"))


def _shown(value: object) -> str:
    return ", ".join(value) or "none" if isinstance(value, tuple) else str(value)


def serving_cluster(config: Config) -> ClusterConfig | None:
    """The serving cluster (routers, hybrids, prefill and decode nodes) or tensor-parallel
    group across hosts that ``--distributed-config`` names, or the 2D mesh whose rank past
    0 this node is; else None (no file, or a pipeline's node: ``place``'s)."""
    if config.distributed_config is None:
        return None
    cfg = load_cluster(config.distributed_config)
    if cfg.mesh:
        node = select_node(cfg, config.node_id or "")
        return cfg if node.is_mesh and node.rank != 0 else None
    return cfg if cfg.serving or cfg.tensor else None


def served_node(cfg: ClusterConfig, node_id: str) -> str:
    """``FILE: node 'ID' (ROLE)`` (``ROLE, rank R`` for a tensor-parallel rank): the node
    of a serving cluster or group that this daemon runs, for messages."""
    node = select_node(cfg, node_id)
    rank = f", rank {node.rank}" if node.is_tensor_rank or node.is_mesh else ""
    return f"{cfg.path}: node {node.id!r} ({node.role}{rank})"


def serving_config(config: Config, flags: Overrides) -> Config:
    """``config`` as ``placed_config`` makes it when ``--distributed-config`` names a
    serving cluster's or tensor-parallel group's node (or a 2D mesh's rank past 0); else
    ``config`` unchanged, its tensor-parallel flags checked against the pipeline's file."""
    cfg = serving_cluster(config)
    if cfg is not None:
        return placed_config(config, cfg, select_node(cfg, config.node_id or ""), flags)
    if config.distributed_config is None:
        return config
    serve = config.serve
    said = tp_origin(flags.tp_size, str(config.config_file or "config"))
    pipeline = load_cluster(config.distributed_config)
    node = select_node(pipeline, config.node_id or "")
    if node.is_mesh:  # a 2D mesh's stage: the file says its group
        _mesh_stage_flags(serve, pipeline, node, said, flags)
    elif serve.tp_size > 1:
        check_tp_node(serve.tp_size, said, node.id, node.role, pipeline.path)
        check_tp_setting(serve.tp_size, said, node_role=serve.node_role,
                         pipeline="distributed_config (--distributed-config)",
                         peers=serve.tp_peers)
    return config


def _mesh_stage_flags(serve: ServeConfig, cfg: ClusterConfig, node: NodeConfig, said: str,
                      flags: Overrides) -> None:
    """A 2D mesh's stage node (rank 0): ``--tp-size`` (``said``) and ``--tp-peers`` (or
    their ``[serve]`` keys) refused unless they say what the file says."""
    where = f"{cfg.path}: node {node.id!r}"
    size = cfg.tensor_parallel_size
    peers = tuple(n.address for n in cfg.stage_ranks(node.id)[1:])
    assert node.layers is not None
    stage = f"layers [{node.layers[0]}, {node.layers[1]}]"
    if serve.tp_size not in (1, size):
        raise ConfigError(f"{said} {serve.tp_size} contradicts --distributed-config: {where} "
                          f"is rank 0 of its stage's tensor-parallel group ({stage}), whose "
                          f"'cluster.tensor_parallel_size' is {size}",
                          hint=f"drop {said}: the cluster TOML's tensor_parallel_size (under "
                          "[cluster]) sets it on every stage")
    if serve.tp_peers and serve.tp_peers != peers:
        given = PEERS_FLAG if flags.tp_peers is not None else "[serve] tp_peers"
        raise ConfigError(f"{given} ({_shown(serve.tp_peers)}) contradicts "
                          f"--distributed-config: {where} says tp_peers = {_shown(peers)} "
                          f"(the agents of its stage's ranks 1 .. {size - 1})",
                          hint=f"drop {given}: the cluster TOML places this node")
