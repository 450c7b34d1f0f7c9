"""A plan from what discovery knows: reachable candidates, their inventory, our model.

Used by ``mlxctl cluster plan`` (through the control API) and ``mlxceld --pp-auto N
--dry-run`` (``make_plan``), and by self-healing (``make_group_plan``: replica groups
re-planned around a lost host, ``groups.py``). Each reachable candidate with an
inventory becomes a ``PlanNode``: its node id, its agent address, its usable memory
(``plan.usable_memory`` of what it reports available), the first stage port it
proposed and its compute units when it reported them (``discovery/speed.py``). A
candidate whose inventory names another model identity than ours is left out, and said
so: its offer would be refused anyway. So is a drained node (`mlxctl
drain`, ``drained``): no plan, heal or activate uses it until `mlxctl undrain`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from mlxceld.cluster.clusterfile.load import dump_cluster, parse_cluster_text
from mlxceld.cluster.plan.groups import plan_groups_around
from mlxceld.cluster.plan.mesh import (
    DEFAULT_MESH,
    MeshChoice,
    MeshMode,
    choose_mesh,
    pipeline_choice,
)
from mlxceld.cluster.plan.mesh_report import MeshJSON, mesh_json, render_mesh
from mlxceld.cluster.plan.model import Plan, PlanNode, Reserve, usable_memory
from mlxceld.cluster.plan.report import PlanJSON, plan_json, render_plan_table
from mlxceld.cluster.plan.solver import plan_replicas
from mlxceld.config.serve import resolve_model
from mlxceld.errors import ConfigError, PlanRefused
from mlxceld.models.fetch import local_model, model_name
from mlxceld.models.identity import CONFIG, model_identity, read_model_config
from mlxceld.models.profile import layer_profile
from mlxceld.roles.options import KVQuant
from mlxceld.state.peers import PeerRow


def plan_nodes(candidates: Sequence[PeerRow], identity: str,
               drained: frozenset[str] = frozenset()) -> tuple[list[PlanNode], list[str]]:
    nodes: list[PlanNode] = []
    notes: list[str] = []
    for c in candidates:
        inv: dict[str, Any] = dict(c.inventory or {})
        ports = inv.get("ports") or []
        name = c.node_id or c.address
        if c.node_id is not None and c.node_id in drained:
            notes.append(f"{name} ({c.address}) is drained: left out of every plan until "
                         f"`mlxctl undrain {name}`")
            continue
        model = inv.get("model") or {}
        theirs = model.get("identity") if isinstance(model, dict) else None
        if theirs is not None and theirs != identity:
            notes.append(f"{name} ({c.address}) has model {theirs}, not {identity}: left out")
            continue
        if c.memory_available is None:
            notes.append(f"{name} ({c.address}) has not reported its memory and ports yet")
            continue
        if not ports:
            notes.append(f"{name} ({c.address}) proposed no free stage port (with "
                         "stage_ports set: every port of that range is taken there): left out")
            continue
        units = inv.get("compute_units")  # checked as the answer came (Inventory)
        nodes.append(PlanNode(name, c.address, usable_memory(c.memory_available),
                              int(ports[0]), float(units) if units else None))
    return nodes, notes


class ProposalJSON(TypedDict):
    """``Proposal.to_json``: the answer of `mlxctl cluster plan`."""

    plan: PlanJSON
    table: str
    toml: str
    notes: list[str]
    model_identity: str
    mesh: MeshJSON  # the meshes considered and the one chosen (mesh.py)


@dataclass(frozen=True)
class Proposal:
    """A plan that fits, with what else it was made of: the model's identity, the cluster
    TOML it pushes, its table for a person, the notes on candidates left out and the mesh
    chosen (a pipeline unless ``--mesh`` said otherwise)."""

    plan: Plan
    model_identity: str
    toml: str
    table: str
    notes: tuple[str, ...]
    mesh: MeshChoice | None = None  # None: a pipeline's (pipeline_choice)

    @property
    def mode(self) -> MeshMode:
        """The --mesh it was planned with (``pp`` for a pipeline's)."""
        return self.mesh.mode if self.mesh else "pp"

    def to_json(self) -> ProposalJSON:
        """For display only (`mlxctl cluster plan --json`): nothing reads it back."""
        return {"plan": plan_json(self.plan), "table": self.table, "toml": self.toml,
                "notes": list(self.notes), "model_identity": self.model_identity,
                "mesh": mesh_json(self.mesh or pipeline_choice(self.plan))}


def make_plan(candidates: Sequence[PeerRow], model: Path, stages: int, *, cluster: str,
              coordinator: str, drained: frozenset[str] = frozenset(),
              replicas: int = 1, kv_quant: KVQuant | None = None,
              mesh: MeshMode = DEFAULT_MESH) -> Proposal:
    """The plan over ``candidates`` but the ``drained`` node ids (``replicas`` groups of
    ``stages`` stages; with a ``mesh`` other than ``pp``, ``stages`` is the number of hosts
    and ``mesh.choose_mesh`` makes them stages and tensor groups), its KV reserve priced at
    ``kv_quant``'s width (``[serve] kv_bits``; None: the model's dtype), with its table,
    its cluster TOML and notes; raises ``PlanRefused`` (naming the shortfall per node)
    when it does not fit, ``ConfigError`` for a mesh beside replicas."""
    identity = model_identity(model)
    nodes, notes = plan_nodes(candidates, identity, drained)
    reserve = Reserve(kv_quant=kv_quant)
    if mesh != "pp" and replicas != 1:
        raise ConfigError(f"--mesh {mesh} with {replicas} replicas is not built: replica "
                          "groups are pipelines", hint="plan one replica with --mesh, or "
                          "replicas with --mesh pp")
    try:
        if mesh == "pp":
            choice = pipeline_choice(plan_replicas(layer_profile(model), stages, replicas,
                                                   nodes, reserve=reserve))
        else:
            choice = choose_mesh(layer_profile(model), stages, nodes, mode=mesh,
                                 config=read_model_config(model), source=str(model / CONFIG),
                                 reserve=reserve)
    except PlanRefused as exc:
        if not notes:
            raise
        raise PlanRefused(f"{exc.message} ({'; '.join(notes)})", hint=exc.hint,
                          shortfalls=exc.shortfalls) from exc
    return _proposal(choice, identity, model, notes, cluster=cluster, coordinator=coordinator)


def make_group_plan(candidates: Sequence[PeerRow], model: Path,
                    groups: Sequence[Sequence[str]], *, cluster: str, coordinator: str,
                    drained: frozenset[str] = frozenset(),
                    kv_quant: KVQuant | None = None) -> Proposal:
    """A heal's or a drain's re-plan of replica ``groups`` (each its hosts' agent
    addresses, in rank order) over ``candidates`` but the ``drained`` node ids: the groups
    that lost a host re-planned over the others, or dropped (``groups.py``); raises
    ``PlanRefused`` when no group is left or a kept one does not fit."""
    identity = model_identity(model)
    nodes, notes = plan_nodes(candidates, identity, drained)
    plan, said = plan_groups_around(layer_profile(model), groups, nodes,
                                    reserve=Reserve(kv_quant=kv_quant))
    return _proposal(pipeline_choice(plan), identity, model, [*said, *notes],
                     cluster=cluster, coordinator=coordinator)


def _proposal(choice: MeshChoice, identity: str, model: Path, notes: Sequence[str], *,
              cluster: str, coordinator: str) -> Proposal:
    # A repo id's snapshot is pushed as the repo id: each host fetches what it needs.
    plan = choice.plan
    text = plan.cluster_text(cluster, model_name(model), coordinator)
    table = render_plan_table(plan)
    if choice.mode != "pp":
        table += "\n" + render_mesh(choice)
    return Proposal(plan, identity, text, table, tuple(notes), choice)


def model_dir(model: str, what: str) -> Path:
    """The local checkpoint directory ``model`` names (a repo id's snapshot,
    ``models/fetch.py``); planning reads its headers."""
    path = local_model(resolve_model(model, Path("/"), what))
    if not path.is_dir():
        raise ConfigError(f"model {model!r} is not a local directory",
                          hint="planning reads the checkpoint's safetensors headers")
    return path


def drafted(proposal: Proposal, draft: tuple[str | None, int]) -> Proposal:
    """``proposal`` with the coordinator's ``[serve] draft_model`` and ``num_draft_tokens``
    in its cluster TOML (``[cluster] draft_model``: each group's last stage runs it, a
    2D mesh's on its rank 0, ``pipeline/speculating.py``); as it was without a draft."""
    model, k = draft
    if model is None:
        return proposal
    cfg = parse_cluster_text(proposal.toml, Path("cluster.toml"))
    return dataclasses.replace(proposal, toml=dump_cluster(dataclasses.replace(
        cfg, draft_model=model, num_draft_tokens=k)))
