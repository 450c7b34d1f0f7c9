"""Re-planning replica groups around lost hosts: a heal or a drain's re-plan of a plan of
``R`` groups of ``S`` stages (``solver.plan_replicas``). Pure and deterministic.

``plan_groups_around(profile, groups, nodes)`` takes the served plan's groups (each its
hosts' agent addresses, in rank order) and the candidates to plan over (``nodes``: the
hosts alive and not drained, spares included). A group whose hosts are all candidates is
*kept*: planned again on its own hosts (``plan_stages`` over them: the same ranks; its
new stages load beside the old ones, so each host's memory now counts the old stage as
used). A group that lost a host is *re-planned* over the candidates no kept group holds
(the spares, and the survivors of lost groups), the groups in their order, each taking the
spares with the most memory (as ``plan_replicas`` does). A lost group that does not fit
there (too few hosts, too little memory) is *dropped*: the plan has fewer groups, and
each dropped group is named in the notes. The groups keep their order, so a kept group
keeps its index unless a group before it was dropped.

It raises ``PlanRefused`` when a kept group does not fit on its own hosts (naming each
stage's shortfall: the re-plan would need the memory of two stages there), or when no
group at all is left. The result has ``replicas`` = the groups left (1: a plain pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mlxceld.cluster.plan.model import Plan, PlanNode, Reserve
from mlxceld.cluster.plan.solver import plan_stages
from mlxceld.errors import PlanRefused
from mlxceld.models.profile import LayerProfile
from mlxceld.wire.address import canonical_address


def plan_groups_around(profile: LayerProfile, groups: Sequence[Sequence[str]],
                       nodes: Sequence[PlanNode], *, reserve: Reserve | None = None
                       ) -> tuple[Plan, list[str]]:
    """The plan of ``groups`` over ``nodes`` (the module docstring), and its notes."""
    by_key = {n.key: n for n in nodes}
    hosts = [[canonical_address(a) for a in g] for g in groups]
    kept = {i for i, g in enumerate(hosts) if all(a in by_key for a in g)}
    held = {a for i in kept for a in hosts[i]}
    spares = [n for n in nodes if n.key not in held]
    planned: list[Plan] = []
    notes: list[str] = []
    for i, g in enumerate(hosts):
        if i in kept:
            try:
                planned.append(plan_stages(profile, len(g), [by_key[a] for a in g],
                                           reserve=reserve))
            except PlanRefused as exc:
                raise PlanRefused(f"replica group {i} ({', '.join(g)}) does not fit beside "
                                  f"its running stages: {exc.message}", hint=exc.hint,
                                  shortfalls=exc.shortfalls) from exc
            continue
        lost = ", ".join(a for a in g if a not in by_key)
        try:
            group = plan_stages(profile, len(g), spares, reserve=reserve)
        except PlanRefused as exc:
            notes.append(f"replica group {i} lost {lost} and does not fit over the hosts "
                         f"left ({exc.message}): dropped, the plan has one group fewer")
            continue
        notes.append(f"replica group {i} lost {lost}: re-planned on "
                     + ", ".join(s.node.key for s in group.stages))
        planned.append(group)
        spares = list(group.spare)
    if not planned:
        raise PlanRefused("plan refused: no replica group fits over the hosts left ("
                          + "; ".join(notes) + ")",
                          hint="bring a host back, or start another peer (mlxceld --pp-peer)")
    return _joined(planned, spares), notes


def _joined(groups: list[Plan], spare: list[PlanNode]) -> Plan:
    """One plan of ``groups``, in their order (group ``j``'s stages from ``j * S``)."""
    size = len(groups[0].stages)
    stages = tuple(replace(s, replica=j, group_start=j * size)
                   for j, g in enumerate(groups) for s in g.stages)
    first = groups[0]
    return Plan(stages, first.num_layers, first.reserve,
                tuple(sorted(spare, key=lambda n: n.key)), first.layer_bytes,
                replicas=len(groups))
