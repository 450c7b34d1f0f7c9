"""The 2D mesh's cluster TOML: a pipeline whose stages are tensor-parallel groups across
hosts (nodes of role ``pipeline_tensor_parallel``, aliases ``pp_tp`` and ``2d``).

::

    [cluster]
    model = "models/qwen3"
    pipeline_parallel_size = 2       # the stages
    tensor_parallel_size = 2         # the ranks of every stage (2 .. 16)
    draft_model = "models/qwen3-0.6b"  # optional: the last stage's rank 0 speculates
    num_draft_tokens = 4             # optional, 1-32 (pipeline/speculating.py)

    [[nodes]]
    id = "coordinator"
    address = "10.0.0.1:19000"       # as in a pipeline's file
    role = "coordinator"

    [[nodes]]
    id = "stage-0"                   # rank 0 of stage 0: runs the ``stage`` worker
    address = "10.0.0.2:19100"       # its stage listener, as a pipeline_stage's
    role = "pipeline_tensor_parallel"
    layers = [0, 14]
    rank = 0

    [[nodes]]
    id = "stage-0-tp-1"              # rank 1 of stage 0: a rank host
    address = "10.0.0.4:19000"       # its agent, as a tensor_parallel_rank's
    role = "pp_tp"
    layers = [0, 14]                 # its stage's: the same layers as its rank 0
    rank = 1

Fields here (each node's, naming the file, the node and the key); the rules across
nodes in ``check_mesh``: one coordinator and the mesh's nodes alone; every stage (its
distinct ``layers``) has ranks 0 .. T-1 once each; ``pipeline_parallel_size`` stages
whose layers follow each other (``rules``' pipeline rule, over the rank-0 nodes).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.cluster.clusterfile.fields import (
    ADDRESS_HINT,
    TOP_KEYS,
    _agent_address,
    _check_keys,
    _draft,
    _host_port,
    _int,
    _layers,
    _node_id,
    _path_str,
    _resources,
    _role,
    _tensor_parallel_size,
)
from mlxceld.cluster.clusterfile.model import (
    COORDINATOR,
    MESH_ROLES,
    PIPELINE_TP,
    ClusterConfig,
    NodeConfig,
)
from mlxceld.cluster.clusterfile.rules import (
    _contiguous,
    _one_coordinator,
    _unique_addresses,
    _unique_ids,
)
from mlxceld.errors import ConfigError
from mlxceld.wire.names import DEFAULT_CLUSTER_NAME, name_problem

MESH_HINT: Final = ("a pipeline of tensor-parallel stages: pipeline_parallel_size = P and "
                    "tensor_parallel_size = T under [cluster], a coordinator, and for each "
                    'stage T nodes of role = "pipeline_tensor_parallel" with its layers and '
                    "rank = 0 .. T-1 (rank 0's address its stage listener, the others' their "
                    "agents)")
MESH_KEYS: Final = ("name", "pipeline_parallel_size", "secret_file", "model",
                    "tensor_parallel_size", "draft_model", "num_draft_tokens")


def is_mesh(data: Mapping[str, Any]) -> bool:
    """Whether the parsed TOML ``data`` has a node of a 2D mesh's role."""
    nodes = data.get("nodes")
    return isinstance(nodes, list) and any(
        isinstance(n, Mapping) and n.get("role") in MESH_ROLES for n in nodes)


def parse_mesh(data: Mapping[str, Any], path: Path) -> ClusterConfig:
    """The 2D mesh's file ``data`` (of ``path``) as a ``ClusterConfig``, field by field."""
    where = str(path)
    _check_keys(data, TOP_KEYS, where, "")
    cluster = data.get("cluster")
    if not isinstance(cluster, Mapping):
        raise ConfigError(f"{where}: there is no [cluster] table", hint=MESH_HINT)
    for key in ("replicas", "kv_compression"):
        if key in cluster:
            why = ("replica groups of a 2D mesh are not built yet" if key == "replicas"
                   else "a pipeline hands no KV cache over")
            raise ConfigError(f"{where}: 'cluster.{key}' is not for a 2D mesh's file (it has "
                              f"{PIPELINE_TP} nodes): {why}", hint=f"remove {key}; {MESH_HINT}")
    _check_keys(cluster, MESH_KEYS, where, "cluster.")
    name = cluster.get("name", DEFAULT_CLUSTER_NAME)
    problem = name_problem(name)
    if problem:
        raise ConfigError(f"{where}: 'cluster.name' {problem}",
                          hint=f'e.g. name = "{DEFAULT_CLUSTER_NAME}"')
    size = _int(cluster, "pipeline_parallel_size", where, "cluster.", minimum=1)
    if size is None:
        raise ConfigError(f"{where}: 'cluster.pipeline_parallel_size' is missing",
                          hint=f"set it to the number of stages; {MESH_HINT}")
    nodes = data.get("nodes")
    assert isinstance(nodes, list)  # is_mesh
    if not all(isinstance(n, Mapping) for n in nodes):
        raise ConfigError(f"{where}: 'nodes' must be an array of tables",
                          hint="write each node as a [[nodes]] table")
    if "tensor_parallel_size" not in cluster:
        raise ConfigError(f"{where}: 'cluster.tensor_parallel_size' is missing: the file has "
                          f"{PIPELINE_TP} nodes, and says how many ranks each stage has",
                          hint=f"set tensor_parallel_size = 2 (or more) under [cluster]; "
                          f"{MESH_HINT}")
    tp = _tensor_parallel_size(cluster, where)
    if tp < 2:
        raise ConfigError(f"{where}: 'cluster.tensor_parallel_size' is {tp} in a file of "
                          f"{PIPELINE_TP} nodes: each stage splits its layers over 2 ranks "
                          "or more", hint="set tensor_parallel_size = 2 (or more), with one "
                          "node per rank of each stage; a pipeline of one-host stages is "
                          "written with pipeline_stage nodes")
    return ClusterConfig(
        name=name, pipeline_parallel_size=size,
        secret_file=_path_str(cluster, "secret_file", where),
        model=_path_str(cluster, "model", where),
        nodes=tuple(_node(raw, i, where, tp) for i, raw in enumerate(nodes)),
        path=path, tensor_parallel_size=tp,
        **_draft(cluster, where))  # the last stage's rank 0 runs it (speculating.py)


def _node(raw: Mapping[str, Any], i: int, where: str, tp: int) -> NodeConfig:
    node_id, at = _node_id(raw, i, where)
    if raw.get("role") not in MESH_ROLES:
        role = _role(raw, at)  # a role it does not know is refused as such there
        if role != COORDINATOR:
            raise ConfigError(f"{at}: role {role!r} beside {PIPELINE_TP} nodes: a 2D mesh's "
                              "file holds one coordinator and the ranks of its stages",
                              hint=f"remove the node, or write its cluster in a file of its "
                              f"own; {MESH_HINT}")
        return _coordinator(raw, node_id, at)
    if "replica" in raw:
        raise ConfigError(f"{at}: a {PIPELINE_TP} node has no 'replica'",
                          hint="remove it: replica groups of a 2D mesh are not built yet")
    rank = _int(raw, "rank", at, "", minimum=0)
    layers = _layers(raw, at)
    for key, value in (("rank", rank), ("layers", layers)):
        if value is None:
            raise ConfigError(f"{at}: '{key}' is missing (every {PIPELINE_TP} node has one)",
                              hint="give each node its stage's layers = [start, end] and its "
                              f"rank in that stage, 0 .. {tp - 1}")
    assert rank is not None
    if rank >= tp:
        raise ConfigError(f"{at}: 'rank' is {rank}, but 'cluster.tensor_parallel_size' is "
                          f"{tp} (ranks 0 .. {tp - 1})",
                          hint=f"give each stage's nodes ranks 0 .. {tp - 1}, one each, or "
                          "raise tensor_parallel_size")
    if rank == 0:
        address, host, port = _stage_address(raw, at)
    else:
        address, addr = _agent_address(raw, at)
        host, port = addr.host, addr.port
    return NodeConfig(id=node_id, address=address, host=host, port=port, role=PIPELINE_TP,
                      rank=rank, layers=layers, **_resources(raw, at))


def _coordinator(raw: Mapping[str, Any], node_id: str, at: str) -> NodeConfig:
    """The coordinator's, as in a pipeline's file: its address, no stage's keys."""
    for key in ("rank", "layers", "replica"):
        if key in raw:
            raise ConfigError(f"{at}: a coordinator has no '{key}'",
                              hint="remove it: the coordinator runs the router (the OpenAI "
                              "port) and holds no layers")
    address, addr = _host_port(raw, at, ADDRESS_HINT)
    return NodeConfig(id=node_id, address=address, host=addr.host, port=addr.port,
                      role=COORDINATOR, **_resources(raw, at))


def _stage_address(raw: Mapping[str, Any], at: str) -> tuple[str, str, int]:
    """Rank 0's address: its stage listener's ``host:port``, as a pipeline_stage's."""
    address, addr = _host_port(
        raw, at, f"rank 0's address is its stage listener's: {ADDRESS_HINT}")
    if addr.is_wildcard:
        raise ConfigError(f"{at}: 'address' {address!r} is a wildcard, which cannot be dialed",
                          hint="give the address the stage before it (or the coordinator) "
                          "dials: the host's own IP or hostname")
    return address, addr.host, addr.port


def check_mesh(cfg: ClusterConfig) -> None:
    """The rules across a 2D mesh's nodes (module docstring)."""
    where = str(cfg.path)
    _unique_ids(cfg.nodes, where)
    _unique_addresses(cfg.nodes, where)
    _one_coordinator(cfg.nodes, where)
    by_stage: dict[tuple[int, int], dict[int, NodeConfig]] = {}
    for n in cfg.nodes:
        if not n.is_mesh:
            continue
        assert n.layers is not None and n.rank is not None  # fields require both
        ranks = by_stage.setdefault(n.layers, {})
        if n.rank in ranks:
            raise ConfigError(f"{where}: node {ranks[n.rank].id!r} and node {n.id!r} both have "
                              f"rank {n.rank} in the stage of layers {list(n.layers)}",
                              hint=_RANKS_HINT)
        ranks[n.rank] = n
    size = cfg.tensor_parallel_size
    for layers, ranks in sorted(by_stage.items()):
        missing = [r for r in range(size) if r not in ranks]
        if missing:
            ids = ", ".join(repr(n.id) for _, n in sorted(ranks.items()))
            raise ConfigError(f"{where}: the stage of layers {list(layers)} ({ids}) has no "
                              f"rank {missing[0]}: 'cluster.tensor_parallel_size' is {size}, "
                              f"so each stage has ranks 0 .. {size - 1}", hint=_RANKS_HINT)
    stages = cfg.stages
    if cfg.pipeline_parallel_size != len(stages):
        ids = ", ".join(repr(n.id) for n in stages)
        raise ConfigError(f"{where}: 'cluster.pipeline_parallel_size' is "
                          f"{cfg.pipeline_parallel_size}, but the file has {len(stages)} "
                          f"stage(s) (their rank 0: {ids})",
                          hint=f"set pipeline_parallel_size = {len(stages)}, or add or remove "
                          "stages (a stage is the nodes of one layers range)")
    _contiguous(stages, where)


_RANKS_HINT: Final = ("a stage is the nodes that name its layers: ranks 0 .. "
                      "tensor_parallel_size-1, one each, with the same layers = [start, end]")
