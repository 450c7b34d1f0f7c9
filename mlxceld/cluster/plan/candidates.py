"""A plan from what discovery knows: reachable candidates, their inventory, our model.

Used by ``mlxctl cluster plan`` (through the control API) and ``mlxceld --pp-auto N
--dry-run``. Each reachable candidate with an inventory becomes a ``PlanNode``: its
node id, its agent address, its usable memory (``plan.usable_memory`` of what it
reports available) and the first stage port it proposed. A candidate whose
inventory names another model identity than ours is left out, and said so: its
offer would be refused anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxceld.cluster.clusterfile.load import dump_cluster
from mlxceld.cluster.plan.model import PlanNode, usable_memory
from mlxceld.cluster.plan.report import plan_json, render_plan_table
from mlxceld.cluster.plan.solver import plan_stages
from mlxceld.errors import PlanRefused
from mlxceld.models.identity import model_identity
from mlxceld.models.profile import layer_profile
from mlxceld.state.peers import PeerRow


def plan_nodes(candidates: Sequence[PeerRow], identity: str) -> tuple[list[PlanNode], list[str]]:
    nodes: list[PlanNode] = []
    notes: list[str] = []
    for c in candidates:
        inv: dict[str, Any] = dict(c.inventory or {})
        ports = inv.get("ports") or []
        name = c.node_id or c.address
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
        nodes.append(PlanNode(name, c.address, usable_memory(c.memory_available),
                              int(ports[0])))
    return nodes, notes


def make_plan(candidates: Sequence[PeerRow], model: Path, stages: int, *, cluster: str,
              coordinator: str) -> dict[str, Any]:
    """The plan as JSON (``plan_json``) plus its table, its cluster TOML and notes;
    raises ``PlanRefused`` (naming the shortfall per node) when it does not fit."""
    identity = model_identity(model)
    nodes, notes = plan_nodes(candidates, identity)
    try:
        plan = plan_stages(layer_profile(model), stages, nodes)
    except PlanRefused as exc:
        if not notes:
            raise
        raise PlanRefused(f"{exc.message} ({'; '.join(notes)})", hint=exc.hint,
                          shortfalls=exc.shortfalls) from exc
    cfg = plan.to_cluster(cluster, str(model), coordinator)
    return {"plan": dict(plan_json(plan)), "table": render_plan_table(plan),
            "toml": dump_cluster(cfg), "notes": notes, "model_identity": identity}
