"""A pipeline plan as values: the candidate nodes, the memory reserve, the stages.

``solver.plan_stages`` makes a ``Plan`` (``solver.plan_replicas``: one of several
replica groups, each a whole pipeline); ``Plan.to_cluster`` turns it into the
cluster TOML that ``--distributed-config`` reads unchanged.

Usable memory is what a node offers for a stage: the memory its inventory
reports available (psutil's ``available``) less a safety fraction, 10 % by
default (``usable_memory``), for the worker process itself, the allocator's
slack and the rest of the machine moving while the plan is carried out. A
platform cap (e.g. Metal's GPU working-set limit on a Mac) is the inventory's
to apply before: pass ``min(available, cap)``.

The reserve is what a stage needs beyond its weights (``Reserve``): the KV
cache of ``context_tokens`` tokens in each of its layers (``context_tokens`` *
the profile's KV bytes per token and layer * its layers; with ``[serve] kv_bits``,
``kv_quant``, those bytes at that width: ``kv_bits / 8`` a key or value element plus
a scale and a bias in the model's dtype per ``kv_group_size`` elements,
``models/kvquant.py``'s ``kv_bytes``) and a fixed
``activation_bytes`` for the activations of one forward step, the logits and
the runtime's buffers. The defaults are 8192 tokens (one sequence at a long
context, or several at a short one) and 512 MiB: twice the MLP activations of
a 2048-token prefill chunk at an intermediate size of 32768 in bfloat16
(tokens * intermediate * 2 for gate and up * 2 bytes = 256 MiB); larger chunks
of larger models need more.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from mlxceld.cluster.clusterfile.load import dump_cluster, parse_cluster_text
from mlxceld.cluster.clusterfile.model import ClusterConfig, StageEntry, pipeline_cluster
from mlxceld.models.kvquant import kv_bytes
from mlxceld.models.profile import LayerProfile
from mlxceld.roles.options import KVQuant
from mlxceld.wire.address import canonical_address, parse_address

MIB: Final = 1 << 20
SAFETY_FRACTION: Final = 0.10
DEFAULT_CONTEXT_TOKENS: Final = 8192
DEFAULT_ACTIVATION_BYTES: Final = 512 * MIB
COORDINATOR_ID: Final = "coordinator"
MESH_ROLE: Final = "pipeline_tensor_parallel"  # a stage's rank in a 2D cluster TOML
SplitRule = Literal["memory", "speed"]  # what the solver balanced: load/memory or load/speed


def usable_memory(available_bytes: int, safety_fraction: float = SAFETY_FRACTION) -> int:
    """What a node with ``available_bytes`` available offers a stage (never below 0)."""
    if not 0 <= safety_fraction < 1:
        raise ValueError(f"safety fraction {safety_fraction} is not within [0, 1)")
    return max(0, available_bytes - math.ceil(available_bytes * safety_fraction))


@dataclass(frozen=True)
class PlanNode:
    """A candidate peer: its node id, its agent address (``host:port``, the identity
    the handshake binds; nodes are ranked by it), the memory it offers
    (``usable_memory``), the port its stage listener would take and its compute units
    when it reported them."""

    node_id: str
    address: str
    memory_usable_bytes: int
    stage_port: int
    compute_units: float | None = None  # its speed (models/speed.py); None: not reported

    @property
    def key(self) -> str:
        return canonical_address(self.address)

    @property
    def stage_address(self) -> str:
        """The stage listener's address: this node's host at ``stage_port``."""
        return parse_address(self.key).with_port(self.stage_port).canonical()


@dataclass(frozen=True)
class Reserve:
    """Memory a stage needs beyond its weights (see the module docstring)."""

    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    activation_bytes: int = DEFAULT_ACTIVATION_BYTES
    kv_quant: KVQuant | None = None  # the KV cache's width: None, the model's dtype

    def __post_init__(self) -> None:
        if self.context_tokens < 0 or self.activation_bytes < 0:
            raise ValueError(f"reserve {self} is negative")

    def token_bytes(self, profile: LayerProfile) -> int:
        """One token's keys and values in one layer, at the cache's width."""
        if self.kv_quant is None or not profile.dtype_bytes:
            return profile.kv_bytes_per_token
        elements = profile.kv_bytes_per_token // profile.dtype_bytes
        return kv_bytes(elements, profile.dtype_bytes, self.kv_quant)

    def layer_bytes(self, profile: LayerProfile) -> int:
        """The KV cache one layer holds."""
        return self.context_tokens * self.token_bytes(profile)

    def stage_bytes(self, profile: LayerProfile, layers: int) -> int:
        return layers * self.layer_bytes(profile) + self.activation_bytes


@dataclass(frozen=True)
class PlannedStage:
    """Stage ``rank`` of replica group ``replica`` (``stage-<index>``, its index among
    all the plan's stages, group by group: ``stage-<rank>`` with one replica): layers
    [start, end) on ``node``. ``group_start``: the index of its group's rank 0.

    ``tp_nodes``: a stage that is a tensor-parallel group across hosts (``mesh.py``) has
    its ranks 1..T-1 here, in rank order (``node`` is rank 0); ``weight_bytes`` and
    ``reserve_bytes`` are then each rank's, and its headroom and speed its tightest
    rank's."""

    rank: int
    node: PlanNode
    layers: tuple[int, int]
    weight_bytes: int
    reserve_bytes: int
    replica: int = 0
    group_start: int = 0
    split_rule: SplitRule = "memory"  # how its group's layers were split (solver.py)
    tp_nodes: tuple[PlanNode, ...] = ()  # its tensor group's ranks 1..T-1 (mesh.py)

    @property
    def ranks(self) -> tuple[PlanNode, ...]:
        """Its nodes in rank order: ``node`` alone, or its tensor group's."""
        return (self.node, *self.tp_nodes)

    @property
    def compute_units(self) -> float | None:
        """Its slowest rank's compute units; None when a rank reported none."""
        units = [n.compute_units for n in self.ranks]
        return None if not all(units) else min(u for u in units if u)

    @property
    def ms_per_token(self) -> float | None:
        """The predicted compute time of one decode step here: its (per-rank) weight bytes
        over its slowest rank's compute units (GB/s of weights, ``models/speed.py``), in
        ms; None without units. A tensor group's all-reduces are ``mesh.py``'s to add."""
        units = self.compute_units
        return None if not units else self.weight_bytes / (units * 1e6)

    @property
    def index(self) -> int:
        """Its place in the plan's stages (and the offer's ``stage``)."""
        return self.group_start + self.rank

    @property
    def stage_id(self) -> str:
        return f"stage-{self.index}"

    @property
    def address(self) -> str:
        return self.node.stage_address

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.reserve_bytes

    @property
    def usable_bytes(self) -> int:
        """The usable memory of its tightest rank (its node's, without a group)."""
        return min(n.memory_usable_bytes for n in self.ranks)

    @property
    def headroom_bytes(self) -> int:
        """What its tightest rank has left once it holds its share."""
        return self.usable_bytes - self.needed_bytes


@dataclass(frozen=True)
class Plan:
    """Stages in rank order (their nodes in lexicographic order of canonical address),
    the layers covered once each (group by group with ``replicas`` groups); ``spare``:
    the candidates left out; ``layer_bytes``: each layer's weights as the profile priced
    them (what the split balanced)."""

    stages: tuple[PlannedStage, ...]
    num_layers: int
    reserve: Reserve
    spare: tuple[PlanNode, ...] = field(default=())
    layer_bytes: tuple[int, ...] = field(default=())
    replicas: int = 1  # groups of len(stages) // replicas stages, group 0's first

    @property
    def stages_per_replica(self) -> int:
        return len(self.stages) // self.replicas

    @property
    def tp_size(self) -> int:
        """The ranks of each stage's tensor group (1: no groups; ``mesh.py`` plans every
        stage with the same number)."""
        return 1 + len(self.stages[0].tp_nodes) if self.stages else 1

    @property
    def fits(self) -> bool:
        """Every rank of every stage holds its share (``headroom_bytes``: the tightest)."""
        return all(s.headroom_bytes >= 0 for s in self.stages)

    def to_cluster(self, name: str, model: str | Path | None, coordinator_address: str,
                   secret_file: str | Path | None = None, *,
                   path: Path = Path("cluster.toml")) -> ClusterConfig:
        """The cluster TOML of this plan, as ``load_cluster`` would read it from ``path``
        (``model`` and ``secret_file`` are written as given: relative to ``path``'s
        directory unless absolute). Each stage's ``memory_bytes`` is its node's usable
        memory. Raises ``ConfigError`` for what the file would not allow (e.g. two
        nodes at one address)."""
        if self.tp_size > 1:
            return parse_cluster_text(self.cluster_text(
                name, model, coordinator_address, secret_file, path=path), path)
        draft = pipeline_cluster(
            name, model, (COORDINATOR_ID, coordinator_address),
            [StageEntry(s.stage_id, s.address, s.layers, s.node.memory_usable_bytes,
                        s.replica) for s in self.stages], secret_file=secret_file, path=path)
        return parse_cluster_text(dump_cluster(draft), path)

    def cluster_text(self, name: str, model: str | Path | None, coordinator_address: str,
                     secret_file: str | Path | None = None, *,
                     path: Path = Path("cluster.toml")) -> str:
        """The cluster TOML of this plan as text: a pipeline's (``to_cluster``), or with
        tensor groups the 2D file (``pipeline_tensor_parallel`` nodes: each stage's rank 0
        at its stage listener, its ranks 1.. at their agent addresses, all with the
        stage's layers; mlxcel-cluster.toml(5))."""
        if self.tp_size == 1:
            return dump_cluster(self.to_cluster(name, model, coordinator_address,
                                                secret_file, path=path))
        head = ["# A cluster of mlxceld nodes; see mlxcel-cluster.toml(5).", "[cluster]",
                f"name = {_toml(name)}", f"pipeline_parallel_size = {len(self.stages)}",
                f"tensor_parallel_size = {self.tp_size}"]
        if secret_file is not None:
            head.append(f"secret_file = {_toml(str(secret_file))}")
        if model is not None:
            head.append(f"model = {_toml(str(model))}")
        lines = [*head, "", "[[nodes]]", f"id = {_toml(COORDINATOR_ID)}",
                 f"address = {_toml(canonical_address(coordinator_address))}",
                 f"role = {_toml(COORDINATOR_ID)}"]
        for s in self.stages:
            for rank, node in enumerate(s.ranks):
                lines += ["", "[[nodes]]",
                          f"id = {_toml(s.stage_id + (f'-tp-{rank}' if rank else ''))}",
                          f"address = {_toml(s.address if rank == 0 else node.key)}",
                          f"role = {_toml(MESH_ROLE)}", f"layers = [{s.layers[0]}, "
                          f"{s.layers[1]}]", f"rank = {rank}", "[nodes.resources]",
                          f"memory_bytes = {node.memory_usable_bytes}"]
        text = "\n".join(lines) + "\n"
        tomllib.loads(text)  # well-formed; its rules are load_cluster's
        return text


def _toml(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value)
