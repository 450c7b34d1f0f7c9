"""Cluster TOML files written for the tests that read them."""

from __future__ import annotations

from pathlib import Path

from mlxceld.cluster.clusterfile.load import dump_cluster
from mlxceld.cluster.clusterfile.model import StageEntry, pipeline_cluster


def write_cluster_toml(tmp_path: Path, model: Path | None,
                       splits: list[tuple[int, int]]) -> Path:
    """``tmp_path/cluster.toml``: a coordinator ``coord`` on 127.0.0.1:19000 and a stage
    ``s{rank}`` on 127.0.0.{2 + rank}:1910{rank} per ``(start, end)`` layer split."""
    path = tmp_path / "cluster.toml"
    stages = [StageEntry(f"s{rank}", f"127.0.0.{2 + rank}:1910{rank}", layers)
              for rank, layers in enumerate(splits)]
    path.write_text(dump_cluster(pipeline_cluster("c", model, ("coord", "127.0.0.1:19000"),
                                                  stages, path=path)))
    return path


# A serving cluster's files (routers over hybrids; prefill and decode pools), written
# by hand: the tests of their rules and of their placement read them.
ROUTER_FILE = """
[cluster]
name = "serve-1"
model = "model"
secret_file = "secret"
{extra}
[[nodes]]
id = "router"
address = "10.0.0.10:19000"
role = "router"
{router_extra}
[[nodes]]
id = "h1"
address = "studio-2.local"
role = "hybrid"

[[nodes]]
id = "h2"
address = "[fd00::13]:19001"
role = "hybrid"
"""

POOLS_FILE = """
[cluster]
model = "model"
kv_compression = "int8+lz4"

[[nodes]]
id = "router"
address = "10.0.0.10"
role = "router"

[[nodes]]
id = "p1"
address = "10.0.0.21"
role = "prefill"

[[nodes]]
id = "d1"
address = "10.0.0.22:19001"
role = "decode"

[[nodes]]
id = "d2"
address = "10.0.0.23"
role = "decode"
"""


def router_file(extra: str = "", router_extra: str = "") -> str:
    """``ROUTER_FILE``: a router over two hybrids, ``extra`` under [cluster] and
    ``router_extra`` in the router's table."""
    return ROUTER_FILE.format(extra=extra, router_extra=router_extra)


# A tensor-parallel group across hosts as mlxcel's reference files write it: node-0 is
# rank 0 (it serves the OpenAI port), node-1 rank 1, named by a hostname.
TENSOR_FILE = """
[cluster]
name = "tp-1"
model = "model"
secret_file = "secret"
tensor_parallel_size = 2
pipeline_parallel_size = 1
{extra}
[[nodes]]
id = "node-0"
address = "10.0.0.10:19000"
role = "tensor_parallel_rank"
rank = 0
{rank0_extra}
[[nodes]]
id = "node-1"
address = "studio-2.local"
role = "tp"
rank = 1
"""


def tensor_file(extra: str = "", rank0_extra: str = "") -> str:
    """``TENSOR_FILE``: ``extra`` under [cluster] and ``rank0_extra`` in node-0's table."""
    return TENSOR_FILE.format(extra=extra, rank0_extra=rank0_extra)


# A 2D mesh as the format decided for it: two stages of two ranks across four hosts, the
# second stage's ranks listed first and spelled by the aliases; rank 0's address is its
# stage listener's, rank 1's its agent's (a host alone: port 19000).
MESH_FILE = """
[cluster]
name = "mesh"
model = "model"
secret_file = "secret"
pipeline_parallel_size = 2
tensor_parallel_size = 2
{extra}
[[nodes]]
id = "coordinator"
address = "10.0.0.1:19000"
role = "coordinator"

[[nodes]]
id = "stage-1-tp-1"
address = "10.0.0.5"
role = "2d"
layers = [1, 2]
rank = 1

[[nodes]]
id = "stage-1"
address = "10.0.0.3:19100"
role = "pp_tp"
layers = [1, 2]
rank = 0

[[nodes]]
id = "stage-0"
address = "10.0.0.2:19100"
role = "pipeline_tensor_parallel"
layers = [0, 1]
rank = 0
{stage0_extra}
[[nodes]]
id = "stage-0-tp-1"
address = "10.0.0.4:19000"
role = "pipeline_tensor_parallel"
layers = [0, 1]
rank = 1
"""


def mesh_file(extra: str = "", stage0_extra: str = "") -> str:
    """``MESH_FILE``: ``extra`` under [cluster] and ``stage0_extra`` in stage-0's table."""
    return MESH_FILE.format(extra=extra, stage0_extra=stage0_extra)
