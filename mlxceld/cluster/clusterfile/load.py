"""The cluster TOML (``--distributed-config FILE --node-id ID``): load, check, write.

::

    [cluster]
    name = "mlxcel-cluster"          # default "mlxcel-cluster"
    pipeline_parallel_size = 2       # the stages of each replica
    replicas = 1                     # optional, 1-8: whole copies of the model, each
                                     # a pipeline of its own (stages say replica = i)
    secret_file = "secret"           # optional; relative to this file's directory
    model = "models/qwen3"           # optional; relative to this file's directory
    draft_model = "models/qwen3-0.6b"  # optional: each group's last stage speculates
    num_draft_tokens = 4             # optional, 1-32 (pipeline/speculating.py)

    [[nodes]]
    id = "coordinator"
    address = "127.0.0.1:19000"      # the identity (host:port) it dials from
    role = "coordinator"             # runs the router; no rank, no layers

    [[nodes]]
    id = "stage-0"
    address = "127.0.0.2:19100"      # its MXCL channel-1 listener
    role = "pipeline_stage"
    replica = 0                      # its group; may be left out when replicas = 1
    rank = 0
    layers = [0, 14]                 # [start, end)
    [nodes.resources]
    memory_bytes = 68719476736       # optional
    compute_units = 0                # optional: the node's speed for plans, 0: the
                                     # daemon measures it (mlxceld/config/compute.py)

A serving cluster instead (no pipeline_parallel_size, no replicas)::

    [cluster]
    model = "models/qwen3"           # every node's model (a router: its tokenizer)
    secret_file = "secret"
    kv_compression = "int8+lz4"      # optional: the routers' KV handoffs
    tensor_parallel_size = 2         # optional, 1-16: each hybrid's --tp-size (none
                                     # with prefill or decode nodes; 1 in a pipeline)

    [[nodes]]
    id = "router"
    address = "10.0.0.10:19000"      # its agent address (a host alone: port 19000)
    role = "router"                  # or hybrid, prefill, decode

A tensor-parallel group across hosts instead (its ranks alone)::

    [cluster]
    model = "models/qwen3"           # every rank's model
    secret_file = "secret"
    tensor_parallel_size = 2         # required: the ranks, one node each

    [[nodes]]
    id = "node-0"
    address = "10.0.0.10:19000"      # its agent address (a host alone: port 19000)
    role = "tensor_parallel_rank"    # or "tp"
    rank = 0                         # rank 0 serves the OpenAI port

A pipeline of tensor-parallel stages across hosts (the 2D mesh) is ``mesh.py``'s.

``load_cluster`` checks everything that needs no model; ``validate_layers``
checks the stages against the model's layer count once it is known. The
format and its rules are documented in man/mlxcel-cluster.toml.5.
"""

from __future__ import annotations

import contextlib
import os
import tomllib
from pathlib import Path

from mlxceld.cluster.clusterfile.fields import parse_cluster
from mlxceld.cluster.clusterfile.mesh import check_mesh, is_mesh, parse_mesh
from mlxceld.cluster.clusterfile.model import ClusterConfig, NodeConfig, select_node
from mlxceld.cluster.clusterfile.rules import check_cluster, validate_layers
from mlxceld.errors import ConfigError
from mlxceld.wire.address import parse_address

__all__ = ["ClusterConfig", "NodeConfig", "dump_cluster", "load_cluster", "needs_secret",
           "parse_cluster_text", "select_node", "validate_layers", "write_cluster"]


def load_cluster(path: Path) -> ClusterConfig:
    """Read and check the cluster TOML ``path`` (everything but the model's layer count)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(f"cluster file {path} does not exist",
                          hint="check --distributed-config; see mlxcel-cluster.toml(5) for "
                          "the format") from exc
    except OSError as exc:
        raise ConfigError(f"cluster file {path} cannot be read: {exc.strerror or exc}",
                          hint="check its permissions") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cluster file {path} is not UTF-8: {exc}",
                          hint="TOML files are UTF-8") from exc
    return parse_cluster_text(text, path)


def parse_cluster_text(text: str, path: Path) -> ClusterConfig:
    """``load_cluster`` for TOML text that ``path`` holds (or will hold)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster file {path} is not valid TOML: {exc}",
                          hint="fix the line it names") from exc
    if is_mesh(data):  # a pipeline of tensor-parallel stages (the 2D mesh)
        cfg = parse_mesh(data, path)
        check_mesh(cfg)
        return cfg
    cfg = parse_cluster(data, path)
    check_cluster(cfg)
    return cfg


def needs_secret(cfg: ClusterConfig) -> bool:
    """Whether the cluster needs a cluster secret: with two stages or more, or nodes on
    more than one host, and always for routers, hybrids, prefill and decode nodes and
    tensor-parallel ranks (a 2D mesh's too). Fails closed: only one stage on the
    coordinator's host does not."""
    if cfg.serving or cfg.tensor or cfg.mesh:
        return True
    hosts = {parse_address(n.address).key()[0] for n in cfg.nodes}
    return len(cfg.stages) > 1 or len(hosts) > 1


def dump_cluster(cfg: ClusterConfig) -> str:
    """TOML text that ``load_cluster`` reads back to ``cfg`` (at the same path)."""
    lines = ["# A cluster of mlxceld nodes; see mlxcel-cluster.toml(5).", "[cluster]",
             f"name = {_string(cfg.name)}"]
    if not cfg.serving and not cfg.tensor:
        lines.append(f"pipeline_parallel_size = {cfg.pipeline_parallel_size}")
    if cfg.kv_compression is not None:
        lines.append(f"kv_compression = {_string(cfg.kv_compression)}")
    if cfg.tensor_parallel_size != 1:
        lines.append(f"tensor_parallel_size = {cfg.tensor_parallel_size}")
    if cfg.replicas > 1:
        lines.append(f"replicas = {cfg.replicas}")
    if cfg.secret_file is not None:
        lines.append(f"secret_file = {_string(cfg.secret_file)}")
    if cfg.model is not None:
        lines.append(f"model = {_string(cfg.model)}")
    if cfg.draft_model is not None:
        lines.append(f"draft_model = {_string(cfg.draft_model)}")
    if cfg.num_draft_tokens is not None:
        lines.append(f"num_draft_tokens = {cfg.num_draft_tokens}")
    for n in cfg.nodes:
        lines += ["", "[[nodes]]", f"id = {_string(n.id)}", f"address = {_string(n.address)}",
                  f"role = {_string(n.role)}"]
        if cfg.replicas > 1 and n.is_stage:
            lines.append(f"replica = {n.replica}")
        if n.rank is not None:
            lines.append(f"rank = {n.rank}")
        if n.layers is not None:
            lines.append(f"layers = [{n.layers[0]}, {n.layers[1]}]")
        resources = [f"{key} = {value!r}" for key, value in (
            ("memory_bytes", n.memory_bytes), ("compute_units", n.compute_units))
            if value is not None]
        if resources:
            lines += ["[nodes.resources]", *resources]
    return "\n".join(lines) + "\n"


def write_cluster(cfg: ClusterConfig, path: Path) -> None:
    """Check ``cfg`` as the file ``path`` and write it there atomically (mode 0666 less
    the umask: the file names a secret file but holds no secret)."""
    path = Path(path)
    text = dump_cluster(cfg)
    parse_cluster_text(text, path)
    try:
        content = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"cluster file {path}: a value cannot be written as UTF-8: {exc}",
                          hint="use names and paths that are valid Unicode text") from exc
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(f"cluster file {path} cannot be written: {exc.strerror or exc}",
                          hint="check that its directory exists and is writable") from exc


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}


def _string(value: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for c in value:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04X}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'
