"""The cluster TOML's tables and keys, read into typed values one field at a time.

Every error names the file, the node (by id, or as ``nodes[2]`` while its id is
the thing that is wrong) and the field. Rules across nodes (unique ids and
addresses, ranks, contiguous layers) are ``rules``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.cluster.clusterfile.model import (
    CLUSTER_ROLES,
    COORDINATOR,
    MESH_ROLES,
    PIPELINE_STAGE,
    PIPELINE_TP,
    SERVING_ROLES,
    TENSOR_RANK,
    ClusterConfig,
    ClusterRole,
    NodeConfig,
)
from mlxceld.config.compute import check_units
from mlxceld.config.disagg import QUANTS
from mlxceld.config.peers import DEFAULT_AGENT_PORT, parse_peers
from mlxceld.errors import ConfigError
from mlxceld.models.tensor import MAX_TP_SIZE
from mlxceld.roles.options import MAX_DRAFT_TOKENS
from mlxceld.types import DECODE_ROLE, MAX_REPLICAS, PREFILL_ROLE
from mlxceld.wire.address import HostPort, parse_address
from mlxceld.wire.names import DEFAULT_CLUSTER_NAME, MAX_NAME, name_problem, shown

TOP_KEYS: Final = ("cluster", "nodes")
CLUSTER_KEYS: Final = ("name", "pipeline_parallel_size", "replicas", "secret_file", "model",
                       "kv_compression", "tensor_parallel_size", "draft_model",
                       "num_draft_tokens")
DRAFT_KEYS: Final = ("draft_model", "num_draft_tokens")  # a pipeline's: its last stages'

NODE_KEYS: Final = ("id", "address", "role", "replica", "rank", "layers", "resources")
RESOURCE_KEYS: Final = ("memory_bytes", "compute_units")
# A tensor-parallel rank's role and mlxcel's alias for it (read as the role).
TENSOR_ROLES: Final = (TENSOR_RANK, "tp")
ID_HINT = 'give every node a unique id of 1-128 printable characters, e.g. id = "stage-0"'
REPLICA_HINT = ("with [cluster] replicas = R, every pipeline_stage names its group: "
                "replica = 0 .. R-1")
ADDRESS_HINT = "write host:port, e.g. 192.168.1.10:19100, or [fd00::10]:19100 for IPv6"
AGENT_HINT = ("a router's, hybrid's, prefill or decode node's address is its agent address "
              "(--agent-addr): host:port, or a host alone for port 19000, e.g. "
              "studio-2.local or 192.168.1.12:19000")
COMPRESSION_HINT = 'one of none, int8, int4, each optionally with +lz4: e.g. "int8+lz4"'
LAYERS_HINT = "for example layers = [0, 14]: layers 0 to 13 (the end is excluded)"
TENSOR_HINT = ("a tensor-parallel group across hosts: tensor_parallel_size = N under "
               '[cluster] and N nodes of role = "tensor_parallel_rank" with rank = 0 .. N-1 '
               "(rank 0 serves the OpenAI port)")


def parse_cluster(data: Mapping[str, Any], path: Path) -> ClusterConfig:
    """The parsed TOML ``data`` of the file ``path`` as a ``ClusterConfig``, field by field."""
    where = str(path)
    _check_keys(data, TOP_KEYS, where, "")
    cluster = data.get("cluster")
    if not isinstance(cluster, Mapping):
        raise ConfigError(f"{where}: there is no [cluster] table",
                          hint="start the file with [cluster] and pipeline_parallel_size = N")
    _check_keys(cluster, CLUSTER_KEYS, where, "cluster.")
    name = cluster.get("name", DEFAULT_CLUSTER_NAME)
    problem = name_problem(name)
    if problem:
        raise ConfigError(f"{where}: 'cluster.name' {problem}",
                          hint=f'use 1-{MAX_NAME} printable characters, e.g. name = '
                          f'"{DEFAULT_CLUSTER_NAME}"')
    raw_nodes = data.get("nodes")
    roles = {n.get("role") for n in raw_nodes if isinstance(n, Mapping)
             and isinstance(n.get("role"), str)} if isinstance(raw_nodes, list) else set()
    drafts = [key for key in DRAFT_KEYS if key in cluster]
    if drafts and roles & set(TENSOR_ROLES + SERVING_ROLES):
        raise ConfigError(f"{where}: 'cluster.{drafts[0]}' is for a pipeline's cluster TOML "
                          "(its last stages run the draft); this one is not a pipeline's",
                          hint="give each hybrid node its own [serve] draft_model "
                          "(--draft-model), or remove it")
    if roles & set(TENSOR_ROLES):
        assert isinstance(raw_nodes, list)
        return _tensor_cluster(cluster, raw_nodes, name, path)
    if roles & set(SERVING_ROLES):
        assert isinstance(raw_nodes, list)
        return _serving_cluster(cluster, raw_nodes, name, path)
    if "kv_compression" in cluster:
        raise ConfigError(f"{where}: 'cluster.kv_compression' is for a cluster of routers, "
                          "hybrids, prefill and decode nodes; this one is a pipeline's",
                          hint="remove it: a pipeline hands no KV cache over")
    size = _int(cluster, "pipeline_parallel_size", where, "cluster.", minimum=1)
    if size is None:
        raise ConfigError(f"{where}: 'cluster.pipeline_parallel_size' is missing",
                          hint="set it to the number of stages in each replica")
    tp = _tensor_parallel_size(cluster, where)
    if tp > 1:
        raise ConfigError(f"{where}: 'cluster.tensor_parallel_size' is {tp} in a pipeline's "
                          f"cluster TOML ('cluster.pipeline_parallel_size' is {size}): "
                          "its pipeline_stage nodes are one host each",
                          hint="remove tensor_parallel_size (or set it to 1) and give each "
                          "stage host its own --tp-size ([serve] tp_size) for a group on "
                          "that host; a stage whose group spans hosts is written with "
                          f'role = "{PIPELINE_TP}" nodes (the 2D mesh)')
    replicas = _int(cluster, "replicas", where, "cluster.", minimum=1)
    replicas = 1 if replicas is None else replicas
    if replicas > MAX_REPLICAS:
        raise ConfigError(f"{where}: 'cluster.replicas' is {replicas}, more than the "
                          f"{MAX_REPLICAS} a cluster serves",
                          hint=f"set replicas = 1 .. {MAX_REPLICAS}")
    nodes = data.get("nodes")
    if not nodes:
        raise ConfigError(f"{where}: there are no [[nodes]]",
                          hint="add one [[nodes]] table per node: a coordinator and the "
                          "pipeline stages")
    if not isinstance(nodes, list) or not all(isinstance(n, Mapping) for n in nodes):
        raise ConfigError(f"{where}: 'nodes' must be an array of tables",
                          hint="write each node as a [[nodes]] table")
    return ClusterConfig(
        name=name,
        pipeline_parallel_size=size,
        secret_file=_path_str(cluster, "secret_file", where),
        model=_path_str(cluster, "model", where),
        nodes=tuple(_node(raw, i, where, replicas) for i, raw in enumerate(nodes)),
        path=path,
        replicas=replicas,
        **_draft(cluster, where),
    )


def _draft(cluster: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A pipeline's ``draft_model`` and ``num_draft_tokens`` (its last stages speculate:
    mlxceld/pipeline/speculating.py)."""
    draft = _path_str(cluster, "draft_model", where)
    k = _int(cluster, "num_draft_tokens", where, "cluster.", minimum=1)
    if k is not None and k > MAX_DRAFT_TOKENS:
        raise ConfigError(f"{where}: 'cluster.num_draft_tokens' is {k}, more than "
                          f"{MAX_DRAFT_TOKENS}", hint=f"set num_draft_tokens = 1 .. "
                          f"{MAX_DRAFT_TOKENS}")
    if k is not None and draft is None:
        raise ConfigError(f"{where}: 'cluster.num_draft_tokens' means nothing without "
                          "'cluster.draft_model': nothing proposes tokens",
                          hint="set draft_model too, or leave num_draft_tokens out")
    return {"draft_model": draft, "num_draft_tokens": k}


def _serving_cluster(cluster: Mapping[str, Any], nodes: list[Any], name: str,
                     path: Path) -> ClusterConfig:
    """A serving cluster: routers over hybrids (replicas) and prefill and decode pools.
    It has no pipeline: no pipeline_parallel_size, no replicas (its hybrids are those)."""
    where = str(path)
    for key in ("pipeline_parallel_size", "replicas"):
        if key in cluster:
            raise ConfigError(f"{where}: 'cluster.{key}' is for a pipeline's cluster; this one "
                              f"has {', '.join(SERVING_ROLES)} nodes",
                              hint=f"remove {key}: a router's replicas are its hybrid nodes")
    if not all(isinstance(n, Mapping) for n in nodes):
        raise ConfigError(f"{where}: 'nodes' must be an array of tables",
                          hint="write each node as a [[nodes]] table")
    compression = cluster.get("kv_compression")
    if compression is not None:
        quant, plus, rest = (compression.partition("+") if isinstance(compression, str)
                             else ("", "", ""))
        if quant not in QUANTS or (plus and rest != "lz4"):
            raise ConfigError(f"{where}: 'cluster.kv_compression' {shown(compression)} is not "
                              "a KV compression", hint=COMPRESSION_HINT)
    parsed = tuple(_node(raw, i, where, 1) for i, raw in enumerate(nodes))
    tp = _tensor_parallel_size(cluster, where)
    pools = [n for n in parsed if n.role in (PREFILL_ROLE, DECODE_ROLE)]
    if tp > 1 and pools:
        raise ConfigError(f"{where}: 'cluster.tensor_parallel_size' is {tp}, and node "
                          f"{pools[0].id!r} is a {pools[0].role} node: tensor parallelism on "
                          "prefill and decode nodes is not built yet",
                          hint="set tensor_parallel_size = 1, or give it a file of routers "
                          "over hybrid nodes only (tensor parallelism runs on the hybrids)")
    return ClusterConfig(
        name=name, pipeline_parallel_size=0,
        secret_file=_path_str(cluster, "secret_file", where),
        model=_path_str(cluster, "model", where),
        nodes=parsed, path=path, kv_compression=compression, tensor_parallel_size=tp)


def _tensor_parallel_size(cluster: Mapping[str, Any], where: str) -> int:
    """``[cluster] tensor_parallel_size``: 1 (the default) .. MAX_TP_SIZE."""
    tp = _int(cluster, "tensor_parallel_size", where, "cluster.", minimum=1)
    if tp is not None and tp > MAX_TP_SIZE:
        raise ConfigError(f"{where}: 'cluster.tensor_parallel_size' is {tp}, more than the "
                          f"{MAX_TP_SIZE} ranks a host's group may have",
                          hint=f"set tensor_parallel_size = 1 .. {MAX_TP_SIZE}")
    return 1 if tp is None else tp


def _tensor_cluster(cluster: Mapping[str, Any], nodes: list[Any], name: str,
                    path: Path) -> ClusterConfig:
    """A tensor-parallel group across hosts: ``tensor_parallel_size`` N (required) over N
    ``tensor_parallel_rank`` nodes. No pipeline (``pipeline_parallel_size`` 1 at most, as
    mlxcel's files say it), no replicas, no KV handoffs."""
    where = str(path)
    for key in ("replicas", "kv_compression"):
        if key in cluster:
            raise ConfigError(f"{where}: 'cluster.{key}' is not for a tensor-parallel group's "
                              "file (it has tensor_parallel_rank nodes)",
                              hint=f"remove {key}; {TENSOR_HINT}")
    pp = _int(cluster, "pipeline_parallel_size", where, "cluster.", minimum=1)
    if pp is not None and pp > 1:
        raise ConfigError(f"{where}: 'cluster.pipeline_parallel_size' is {pp} in a file of "
                          "tensor_parallel_rank nodes, which are one group of the whole "
                          "model", hint=f"remove pipeline_parallel_size (or set it to 1); "
                          f"{TENSOR_HINT}; a pipeline of tensor-parallel stages is written "
                          f'with role = "{PIPELINE_TP}" nodes (the 2D mesh)')
    if not all(isinstance(n, Mapping) for n in nodes):
        raise ConfigError(f"{where}: 'nodes' must be an array of tables",
                          hint="write each node as a [[nodes]] table")
    count = sum(1 for n in nodes if n.get("role") in TENSOR_ROLES)
    if "tensor_parallel_size" not in cluster:
        raise ConfigError(f"{where}: 'cluster.tensor_parallel_size' is missing: the file has "
                          f"{count} tensor_parallel_rank node(s), and says how many ranks its "
                          "group has", hint=f"set tensor_parallel_size = {max(count, 2)} under "
                          "[cluster]")
    tp = _tensor_parallel_size(cluster, where)
    if tp < 2:
        raise ConfigError(f"{where}: 'cluster.tensor_parallel_size' is {tp} in a file of "
                          "tensor_parallel_rank nodes: a group splits the model over 2 ranks "
                          "or more", hint=f"set tensor_parallel_size = {max(count, 2)}, with "
                          "one node per rank")
    return ClusterConfig(
        name=name, pipeline_parallel_size=0,
        secret_file=_path_str(cluster, "secret_file", where),
        model=_path_str(cluster, "model", where),
        nodes=tuple(_node(raw, i, where, 1, tp) for i, raw in enumerate(nodes)),
        path=path, tensor_parallel_size=tp)


def _tensor_node(raw: Mapping[str, Any], node_id: str, at: str, tp: int) -> NodeConfig:
    """A tensor-parallel rank's: its agent address (rank 0 dials the others' there) and its
    ``rank``, 0 .. ``tp``-1; none of a stage's keys, no resources (nothing reads them)."""
    for key in ("layers", "replica", "resources"):
        if key in raw:
            raise ConfigError(f"{at}: a {TENSOR_RANK} node has no '{key}'",
                              hint="remove it: each rank holds a slice of every layer (1/N "
                              "of its weights), split evenly; a host's speed is its "
                              "[daemon] compute_units")
    normal, addr = _agent_address(raw, at)
    rank = _int(raw, "rank", at, "", minimum=0)
    if rank is None:
        raise ConfigError(f"{at}: 'rank' is missing (every {TENSOR_RANK} node has one)",
                          hint=f"ranks are 0 .. {tp - 1} ('cluster.tensor_parallel_size' is "
                          f"{tp}), one each; rank 0 serves the OpenAI port")
    if rank >= tp:
        raise ConfigError(f"{at}: 'rank' is {rank}, but 'cluster.tensor_parallel_size' is "
                          f"{tp} (ranks 0 .. {tp - 1})",
                          hint=f"give the group's nodes ranks 0 .. {tp - 1}, one each, or "
                          "raise tensor_parallel_size")
    return NodeConfig(id=node_id, address=normal, host=addr.host, port=addr.port,
                      role=TENSOR_RANK, rank=rank)


def _serving_node(raw: Mapping[str, Any], node_id: str, role: ClusterRole, at: str) -> NodeConfig:
    """A router's, hybrid's, prefill or decode node's: its agent address (normalized as
    --replicas normalizes it), and none of a stage's keys."""
    for key in ("rank", "layers", "replica"):
        if key in raw:
            raise ConfigError(f"{at}: a {role} node has no '{key}'",
                              hint="remove it: rank, layers and replica are a pipeline "
                              "stage's; a hybrid, prefill or decode node holds the whole model")
    normal, addr = _agent_address(raw, at)
    return NodeConfig(id=node_id, address=normal, host=addr.host, port=addr.port, role=role,
                      **_resources(raw, at))


def _agent_address(raw: Mapping[str, Any], at: str) -> tuple[str, HostPort]:
    """A node's agent address, normalized as --replicas normalizes it (a host alone: port
    19000), and parsed; never a wildcard."""
    address = raw.get("address")
    if not isinstance(address, str) or not address.strip():
        what = ("is missing" if address is None
                else f"must be a host or host:port, not {shown(address)}")
        raise ConfigError(f"{at}: 'address' {what}", hint=AGENT_HINT)
    (normal,) = parse_peers([address], f"{at}: 'address'", default_port=DEFAULT_AGENT_PORT,
                            hint=AGENT_HINT)
    addr = parse_address(normal)
    if addr.is_wildcard:
        raise ConfigError(f"{at}: 'address' {address!r} is a wildcard, which names no host "
                          "to dial", hint=AGENT_HINT)
    return normal, addr


def _node_id(raw: Mapping[str, Any], i: int, where: str) -> tuple[str, str]:
    """Node ``i``'s id, checked with its keys, and how messages name it (by its id, or by
    its index while the id is wrong)."""
    node_id = raw.get("id")
    problem = "is missing" if node_id is None else name_problem(node_id)
    at = f"{where}: nodes[{i}]" if problem else f"{where}: node {node_id!r}"
    _check_keys(raw, NODE_KEYS, at, "")
    if problem:
        raise ConfigError(f"{at}: 'id' {problem}", hint=ID_HINT)
    return str(node_id), at


def _node(raw: Mapping[str, Any], i: int, where: str, replicas: int, tp: int = 1) -> NodeConfig:
    node_id, at = _node_id(raw, i, where)
    if raw.get("role") in TENSOR_ROLES:
        return _tensor_node(raw, node_id, at, tp)
    if raw.get("role") in SERVING_ROLES:
        return _serving_node(raw, node_id, _role(raw, at), at)
    role = _role(raw, at)  # first: the role says how the address reads
    address, addr = _host_port(raw, at, ADDRESS_HINT)
    rank = _int(raw, "rank", at, "", minimum=0)
    layers = _layers(raw, at)
    replica = _int(raw, "replica", at, "", minimum=0)
    group = 0
    if role == COORDINATOR:
        for key in ("rank", "layers", "replica"):
            if key in raw:
                raise ConfigError(f"{at}: a coordinator has no '{key}'",
                                  hint="remove it: the coordinator runs the router (the "
                                  "OpenAI port) and holds no layers")
    else:
        for key, value in (("rank", rank), ("layers", layers)):
            if value is None:
                raise ConfigError(f"{at}: '{key}' is missing (every {PIPELINE_STAGE} has one)",
                                  hint="stages have rank = 0, 1, ... in pipeline order, and "
                                  "layers = [start, end]")
        if addr.ip is not None and addr.ip.is_unspecified:
            raise ConfigError(f"{at}: 'address' {address!r} is a wildcard, which cannot be dialed",
                              hint="give the address the stage before it (or the coordinator) "
                              "dials: the host's own IP or hostname")
        group = _replica(replica, replicas, at)
    return NodeConfig(id=node_id, address=address, host=addr.host, port=addr.port, role=role,
                      rank=rank, layers=layers, **_resources(raw, at), replica=group)


def _replica(replica: int | None, replicas: int, at: str) -> int:
    """A stage's group: 0 when left out with one replica; required with more."""
    if replica is None:
        if replicas > 1:
            raise ConfigError(f"{at}: 'replica' is missing ([cluster] replicas is {replicas})",
                              hint=REPLICA_HINT)
        return 0
    if replica >= replicas:
        raise ConfigError(f"{at}: 'replica' is {replica}, but [cluster] replicas is "
                          f"{replicas} (groups 0..{replicas - 1})", hint=REPLICA_HINT)
    return replica


def _host_port(raw: Mapping[str, Any], at: str, hint: str) -> tuple[str, HostPort]:
    """A node's ``address`` as written and parsed as ``host:port`` (``hint`` when it is
    missing, not a string or not an address)."""
    address = raw.get("address")
    if not isinstance(address, str):
        what = "is missing" if address is None else f"must be a string, not {shown(address)}"
        raise ConfigError(f"{at}: 'address' {what}", hint=hint)
    try:
        return address, parse_address(address)
    except ValueError as exc:
        raise ConfigError(f"{at}: 'address' {address!r} {exc}", hint=hint) from None


def _role(raw: Mapping[str, Any], at: str) -> ClusterRole:
    role = raw.get("role")
    hint = (f'set role = "{COORDINATOR}" or role = "{PIPELINE_STAGE}" (a pipeline), or '
            'role = "router", "hybrid", "prefill" or "decode" (replicas and pools), or '
            'role = "tensor_parallel_rank" (a tensor-parallel group across hosts), or '
            f'role = "{PIPELINE_TP}" (a pipeline of tensor-parallel stages)')
    for known in CLUSTER_ROLES:
        if role == known:
            return known
    if role in TENSOR_ROLES:
        return TENSOR_RANK  # "tp": mlxcel's alias
    if role in MESH_ROLES:
        return PIPELINE_TP  # "pp_tp", "2d": mlxcel's aliases (their file is mesh.py's)
    if role is None:
        raise ConfigError(f"{at}: 'role' is missing", hint=hint)
    raise ConfigError(f"{at}: 'role' {shown(role)} is not one of {', '.join(CLUSTER_ROLES)}",
                      hint=hint)


def _layers(raw: Mapping[str, Any], at: str) -> tuple[int, int] | None:
    value = raw.get("layers")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ConfigError(f"{at}: 'layers' must be [start, end] with two integers, "
                          f"not {shown(value)}", hint=LAYERS_HINT)
    start, end = value
    if start < 0:
        raise ConfigError(f"{at}: 'layers' [{start}, {end}] starts below 0", hint=LAYERS_HINT)
    if start >= end:
        raise ConfigError(f"{at}: 'layers' [{start}, {end}] holds no layer: the end is "
                          "excluded, so it must be above the start", hint=LAYERS_HINT)
    return start, end


def _resources(raw: Mapping[str, Any], at: str) -> dict[str, Any]:
    """``[nodes.resources]``: ``memory_bytes`` and ``compute_units`` (0: measured), as
    NodeConfig fields."""
    table = raw.get("resources", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"{at}: 'resources' must be a table",
                          hint="write it as [nodes.resources] under the node's [[nodes]]")
    _check_keys(table, RESOURCE_KEYS, at, "resources.")
    units = table.get("compute_units")
    return {"memory_bytes": _int(table, "memory_bytes", at, "resources.", minimum=1),
            "compute_units": None if units is None
            else check_units(units, f"{at}: 'resources.compute_units'")}


def _int(table: Mapping[str, Any], key: str, at: str, prefix: str,
         *, minimum: int) -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{at}: '{prefix}{key}' must be an integer, not {shown(value)}",
                          hint=f"write it without quotes, e.g. {key} = {max(minimum, 1)}")
    if value < minimum:
        raise ConfigError(f"{at}: '{prefix}{key}' must be at least {minimum}, not {value}",
                          hint=f"for example {key} = {max(minimum, 1)}")
    return value


def _path_str(table: Mapping[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\0" in value:
        what = "path or Hugging Face repo id" if key in ("model", "draft_model") else "path"
        raise ConfigError(f"{where}: 'cluster.{key}' must be a non-empty {what}, "
                          f"not {shown(value)}",
                          hint=f'write it as {key} = "PATH", relative to this file\'s directory')
    return value


def _check_keys(table: Mapping[str, Any], known: tuple[str, ...], at: str, prefix: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(f"{at}: unknown key '{prefix}{key}'",
                              hint=f"known keys here: {', '.join(prefix + k for k in known)}")
