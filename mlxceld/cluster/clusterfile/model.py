"""The cluster TOML as typed values: one ``ClusterConfig`` holding its ``NodeConfig`` s.

Built and validated by ``mlxceld.cluster.clusterfile.load.load_cluster``; a value made
by hand is checked when ``write_cluster`` writes it.

A tensor-parallel group across hosts: ``tensor_parallel_size`` N nodes of role
``tensor_parallel_rank``, ranks 0 .. N-1; rank 0 serves the OpenAI port (``--tp-size N
--tp-peers`` the others' agent addresses), the others run as ``--node-role
tensor_parallel_rank`` (``placement.placed_config``).

A pipeline of tensor-parallel stages (the 2D mesh): ``pipeline_parallel_size`` P stages,
each a group of ``tensor_parallel_size`` T nodes of role ``pipeline_tensor_parallel``
(aliases ``pp_tp``, ``2d``) with the same ``layers`` and ranks 0 .. T-1. A stage's rank 0
(its ``address`` its stage listener's) runs the ``stage`` worker, with the group across
hosts (``Placement.tp_peers``); its other ranks (their ``address`` their agents') run as
``--node-role tensor_parallel_rank``. ``stages`` are the rank-0 nodes in layers order.

Replica groups: a cluster of ``replicas`` R serves R whole copies of the model, each a
pipeline of ``pipeline_parallel_size`` S stages (its *group*: the stages of one
``replica``); the coordinator's router spreads requests over the groups. With R = 1
there is one group, replica 0, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, NamedTuple

from mlxceld.config.secrets import TomlSecretFile
from mlxceld.errors import ConfigError
from mlxceld.models.fetch import is_repo_id
from mlxceld.types import (
    DECODE_ROLE,
    HYBRID,
    PREFILL_ROLE,
    ROUTER_ROLE,
    TENSOR_RANK_ROLE,
    NodeRole,
)
from mlxceld.wire.address import parse_address

COORDINATOR: Final = "coordinator"
PIPELINE_STAGE: Final = "pipeline_stage"
# A serving cluster's roles are node roles (``--node-role``, config/replicas.py): routers
# over hybrid replicas and/or prefill and decode pools, in the order this file names them.
# Their ``address`` is the node's agent address.
SERVING_ROLES: Final[tuple[NodeRole, ...]] = (ROUTER_ROLE, HYBRID, PREFILL_ROLE, DECODE_ROLE)
# A rank of a tensor-parallel group across hosts; its ``address`` is its agent address.
TENSOR_RANK: Final = TENSOR_RANK_ROLE
# A rank of a pipeline stage that is a tensor-parallel group across hosts (the 2D mesh),
# and mlxcel's aliases for it (read as the role). Rank 0's ``address`` is its stage
# listener's, every other rank's its agent's.
PIPELINE_TP: Final = "pipeline_tensor_parallel"
MESH_ROLES: Final = (PIPELINE_TP, "pp_tp", "2d")
ClusterRole = Literal["coordinator", "pipeline_stage", "pipeline_tensor_parallel"] | NodeRole
CLUSTER_ROLES: Final[tuple[ClusterRole, ...]] = (COORDINATOR, PIPELINE_STAGE, *SERVING_ROLES,
                                                 TENSOR_RANK, PIPELINE_TP)


@dataclass(frozen=True)
class NodeConfig:
    """One ``[[nodes]]`` table. ``address`` is as written; ``host`` (no brackets) and
    ``port`` are parsed from it. Stages have ``rank`` and ``layers`` ([start, end)),
    the coordinator neither; a tensor-parallel rank its ``rank`` alone."""

    id: str
    address: str
    host: str
    port: int
    role: ClusterRole
    rank: int | None = None
    layers: tuple[int, int] | None = None
    memory_bytes: int | None = None
    replica: int = 0  # a stage's group (0 on the coordinator, which has none)
    compute_units: float | None = None  # [nodes.resources]; 0: measured (config/compute.py)

    @property
    def is_stage(self) -> bool:
        """A pipeline stage: a ``pipeline_stage`` node, or rank 0 of a 2D mesh's stage."""
        return self.role == PIPELINE_STAGE or (self.is_mesh and self.rank == 0)

    @property
    def is_mesh(self) -> bool:
        """A rank of a 2D mesh's stage (role ``pipeline_tensor_parallel``)."""
        return self.role == PIPELINE_TP

    @property
    def is_serving(self) -> bool:
        """A router, hybrid, prefill or decode node (of a serving cluster)."""
        return self.role in SERVING_ROLES

    @property
    def is_tensor_rank(self) -> bool:
        """A rank of the file's tensor-parallel group across hosts."""
        return self.role == TENSOR_RANK

    def describe(self) -> str:
        """``node 'stage-1' (rank 1, layers [14, 28])`` for messages (``replica 1, rank
        1, ...`` in a group past the first)."""
        if self.layers is None:
            return f"node {self.id!r}"
        if self.is_mesh:
            return (f"node {self.id!r} (layers [{self.layers[0]}, {self.layers[1]}], "
                    f"rank {self.rank})")
        group = f"replica {self.replica}, " if self.replica else ""
        return (f"node {self.id!r} ({group}rank {self.rank}, layers [{self.layers[0]}, "
                f"{self.layers[1]}])")


@dataclass(frozen=True)
class ClusterConfig:
    """The whole file. ``secret_file`` and ``model`` are as written (relative to the
    file's directory unless absolute); ``path`` is the file it was read from."""

    name: str
    pipeline_parallel_size: int
    secret_file: str | None
    model: str | None
    nodes: tuple[NodeConfig, ...]
    path: Path
    replicas: int = 1  # groups of pipeline_parallel_size stages, each a whole model
    kv_compression: str | None = None  # a serving cluster's routers' (config/disagg.py)
    # A serving cluster's hybrids' tp_size (config/tensor.py), the ranks of a
    # tensor-parallel group across hosts, or of each stage of a 2D mesh; a pipeline's of
    # pipeline_stage nodes is always 1.
    tensor_parallel_size: int = 1
    # A pipeline's draft model, as written, and its k: each group's last stage runs it
    # (pipeline/speculating.py); None: no draft.
    draft_model: str | None = None
    num_draft_tokens: int | None = None

    @property
    def serving(self) -> bool:
        """A serving cluster (routers over hybrids, prefill and decode nodes), not a
        pipeline (``pipeline_parallel_size`` is 0 there)."""
        return any(n.is_serving for n in self.nodes)

    @property
    def tensor(self) -> bool:
        """A tensor-parallel group across hosts (``tensor_parallel_rank`` nodes), not a
        pipeline (``pipeline_parallel_size`` is 0 there) nor a serving cluster."""
        return any(n.is_tensor_rank for n in self.nodes)

    @property
    def mesh(self) -> bool:
        """A pipeline of tensor-parallel stages across hosts (``pipeline_tensor_parallel``
        nodes): a pipeline whose ``stages`` are their rank-0 nodes."""
        return any(n.is_mesh for n in self.nodes)

    def stage_ranks(self, node_id: str) -> tuple[NodeConfig, ...]:
        """The ranks of ``node_id``'s stage in a 2D mesh (the nodes of its ``layers``) in
        rank order: rank 0 (the stage) first; () for a node of no mesh stage."""
        node = select_node(self, node_id)
        if not node.is_mesh:
            return ()
        return tuple(sorted((n for n in self.nodes if n.is_mesh and n.layers == node.layers),
                            key=lambda n: n.rank or 0))

    @property
    def tensor_ranks(self) -> tuple[NodeConfig, ...]:
        """The tensor-parallel group's nodes in rank order: rank 0 first."""
        return tuple(sorted((n for n in self.nodes if n.is_tensor_rank),
                            key=lambda n: n.rank or 0))

    def with_role(self, role: str) -> tuple[NodeConfig, ...]:
        """The nodes of ``role``, in file order."""
        return tuple(n for n in self.nodes if n.role == role)

    @property
    def stages(self) -> tuple[NodeConfig, ...]:
        """The pipeline stages in (replica, rank) order: group 0's, then group 1's, ...
        (a 2D mesh's: its stages' rank-0 nodes in the order of their layers)."""
        if self.mesh:
            return tuple(sorted((n for n in self.nodes if n.is_stage),
                                key=lambda n: n.layers or (0, 0)))
        return tuple(sorted((n for n in self.nodes if n.is_stage),
                            key=lambda n: (n.replica, n.rank or 0)))

    @property
    def groups(self) -> tuple[tuple[NodeConfig, ...], ...]:
        """Each replica's stages in rank order, replica 0 first (one group when R = 1)."""
        stages = self.stages
        return tuple(tuple(n for n in stages if n.replica == i)
                     for i in range(self.replicas))

    def group_of(self, node_id: str) -> tuple[NodeConfig, ...]:
        """The stages of ``node_id``'s group in rank order (group 0 for the coordinator)."""
        return self.groups[select_node(self, node_id).replica]

    @property
    def coordinator(self) -> NodeConfig:
        for n in self.nodes:
            if n.role == COORDINATOR:
                return n
        raise ConfigError(f"{self.path}: no node has role {COORDINATOR!r}",
                          hint="add a [[nodes]] table with role = \"coordinator\"")

    def node(self, node_id: str) -> NodeConfig | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def model_path(self) -> Path | None:
        """``model`` resolved against the file's directory (``~`` expanded)."""
        return None if self.model is None else _resolve(self.model, self.path)

    def model_source(self) -> str | None:
        """``model`` as a daemon takes it: ``model_path``, or the Hugging Face repo id
        ``model`` names when no such path exists (``models/fetch.py``)."""
        path = self.model_path()
        if path is None or self.model is None:
            return None
        return self.model if not path.exists() and is_repo_id(self.model) else str(path)

    def draft_source(self) -> str | None:
        """``draft_model`` as a daemon takes it (as ``model_source``)."""
        if self.draft_model is None:
            return None
        path = _resolve(self.draft_model, self.path)
        return self.draft_model if not path.exists() and is_repo_id(self.draft_model) \
            else str(path)

    def secret_source(self) -> TomlSecretFile | None:
        """``secret_file`` as ``resolve_secret``'s ``[cluster] secret_file`` source."""
        return None if self.secret_file is None else TomlSecretFile(self.secret_file, self.path)

    def upstream_of(self, node_id: str) -> NodeConfig | None:
        """Who sends activations to ``node_id``: the stage of the rank before in its
        group, the coordinator for rank 0, nobody for the coordinator."""
        order = self._flow(node_id)
        i = order.index(select_node(self, node_id))
        return order[i - 1] if i > 0 else None

    def downstream_of(self, node_id: str) -> NodeConfig | None:
        """Whom ``node_id`` sends activations to: rank 0 (of group 0) for the
        coordinator, the next rank of its group for a stage, nobody for a group's last
        stage (it answers the coordinator with token ids, not activations)."""
        order = self._flow(node_id)
        i = order.index(select_node(self, node_id))
        return order[i + 1] if i + 1 < len(order) else None

    def _flow(self, node_id: str) -> list[NodeConfig]:
        return [self.coordinator, *self.group_of(node_id)]


class StageEntry(NamedTuple):
    """One stage of ``pipeline_cluster``: its id, address, layers [start, end), memory
    and replica group."""

    id: str
    address: str
    layers: tuple[int, int]
    memory_bytes: int | None = None
    replica: int = 0


def pipeline_cluster(name: str, model: str | Path | None, coordinator: tuple[str, str],
                     stages: Sequence[StageEntry], *, secret_file: str | Path | None = None,
                     path: Path = Path("cluster.toml")) -> ClusterConfig:
    """A pipeline's cluster TOML as a value: the coordinator ``(id, address)`` and each
    stage, group by group (``StageEntry.replica``: 0, 0, 1, 1 for two replicas of two
    stages), in rank order within its group; ``model`` and ``secret_file`` as written
    (relative to ``path``'s directory unless absolute). Not checked: ``write_cluster``
    (or ``parse_cluster_text`` over ``dump_cluster``) checks it. Raises ``ConfigError``
    for an address that is not ``host:port``."""
    replicas = max((s.replica for s in stages), default=0) + 1
    nodes = [_node(coordinator[0], coordinator[1], None, None, None)]
    ranks: dict[int, int] = {}
    for s in stages:
        rank = ranks[s.replica] = ranks.get(s.replica, -1) + 1
        nodes.append(_node(s.id, s.address, rank, s.layers, s.memory_bytes, s.replica))
    return ClusterConfig(name=name, pipeline_parallel_size=len(stages) // replicas,
                         secret_file=None if secret_file is None else str(secret_file),
                         model=None if model is None else str(model), nodes=tuple(nodes),
                         path=path, replicas=replicas)


def _node(node_id: str, address: str, rank: int | None, layers: tuple[int, int] | None,
          memory: int | None, replica: int = 0) -> NodeConfig:
    where = parse_address(address)
    return NodeConfig(id=node_id, address=address, host=where.host, port=where.port,
                      role=COORDINATOR if rank is None else PIPELINE_STAGE,
                      rank=rank, layers=layers, memory_bytes=memory,
                      replica=replica)


def select_node(cfg: ClusterConfig, node_id: str) -> NodeConfig:
    """The node ``--node-id`` names, or an error listing the ids there are."""
    node = cfg.node(node_id)
    if node is None:
        known = ", ".join(repr(n.id) for n in cfg.nodes) or "none"
        raise ConfigError(f"{cfg.path}: no node has id {node_id!r}; the ids are: {known}",
                          hint="pass --node-id with one of those ids")
    return node


def _resolve(value: str, toml_path: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else toml_path.parent / p
