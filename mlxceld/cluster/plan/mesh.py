"""The mesh: how N hosts run a model, as P pipeline stages each a tensor group of T ranks
(P x T = N). Pure and deterministic.

``choose_mesh(profile, hosts, nodes, mode=..., config=...)`` plans every mesh ``mode``
allows over the candidates ``nodes`` and picks one:

``pp`` (the default: the plans of before, unchanged)
    N stages, no tensor groups: ``solver.plan_stages``.
``tp``
    One stage, a tensor group of N ranks.
``2d``
    P stages of T ranks with P >= 2 and T >= 2: T = 2 when N is even, else the smallest
    divisor of N from 3 up (9 hosts: 3 x 3), and the next divisor when the model does
    not split over that T or the mesh does not fit. N prime (or below 4) has no such
    mesh: refused, saying so.
``auto``
    Every P x T = N (T = 1, the pipeline, among them) where the model splits over T
    (``models/tensor.py``) and P is at most its layers; of those that fit, the least
    predicted time per token. Without compute units on every candidate speed cannot be
    weighed: the pipeline is kept when it fits (else the fitting mesh with the most
    stages, the fewest all-reduces), and the reason says so.

**Groups.** The N hosts with the most usable memory (ties by address) are taken, by
memory from the most, in groups of T (hosts of like memory together, since a group is
as big as its smallest rank); a group's rank 0 is its host first by address, and the
stages are ordered by their rank 0's address, as a pipeline's. The layers are split as
a pipeline's (``plan_stages``: by memory, or by speed when the groups' slowest ranks
differ) over one node per group that has its smallest rank's memory and its slowest
rank's compute units.

**Memory per rank.** mlx-lm's ``shard`` cuts each layer's attention heads, KV heads and
MLP across the ranks, so a rank holds its stage's layer weights / T (rounded up; the
norms and an MoE router, kept whole, are small beside them), the KV reserve / T (the KV
heads are cut), and whole on every rank what it does not cut (``models/tensor_modes.py``):
the token embedding always, the head unless mlx-lm cuts it by vocabulary for this model
(``head_mode``), the final norm, anything else, and the activation slack.
``rank_profile`` is the model's profile so divided; ``Plan.fits`` then checks every rank.

**Time per token** (``predicted_ms``), one sequence decoding: each stage's compute (its
per-rank weights over its slowest rank's units: ``PlannedStage.ms_per_token``), plus two
all-reduces per layer in a group (after attention and after the MLP), each ``2 (T - 1)``
ring steps of ``LINK_COSTS[link].ring_step_ms``, plus ``hop_ms`` for each stage boundary.
The link costs are assumptions, not measurements (named in each choice's reason): one
token's hidden state is a few KiB, so both are latency: a TCP step between hosts on
Ethernet is about 0.1 ms (a one-way trip through two kernels), RDMA over Thunderbolt
(mlx's JACCL) about 0.01 ms; a hop is one MXCL frame (sealed, sent, opened), about 0.3 ms.
Plans price ``tcp``: the ring over TCP is the only group transport built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from mlxceld.cluster.plan.model import Plan, PlanNode, Reserve
from mlxceld.cluster.plan.solver import plan_stages, rank_nodes
from mlxceld.errors import PlanRefused
from mlxceld.models.profile import LayerProfile
from mlxceld.models.tensor import TensorParallelRefused, check_tensor_parallel
from mlxceld.models.tensor_modes import head_mode
from mlxceld.types import DEFAULT_MESH, MESH_MODES, MeshMode, parse_mesh

LinkKind = Literal["tcp", "rdma"]


@dataclass(frozen=True)
class LinkCost:
    """What the planner assumes of a link between two hosts (the module docstring)."""

    ring_step_ms: float  # one step of a ring all-reduce of one token's hidden state
    hop_ms: float  # one token's activations from a stage to the next


LINK_COSTS: Final[dict[LinkKind, LinkCost]] = {
    "tcp": LinkCost(ring_step_ms=0.1, hop_ms=0.3),
    "rdma": LinkCost(ring_step_ms=0.01, hop_ms=0.3),
}
PLANNED_LINK: Final[LinkKind] = "tcp"  # the ring over TCP: the only group transport built


@dataclass(frozen=True)
class MeshOption:
    """One mesh considered: P stages x T ranks, its plan when it fits, else why not;
    ``ms_per_token``: predicted (``predicted_ms``), None without compute units."""

    stages: int
    tp_size: int
    plan: Plan | None
    ms_per_token: float | None = None
    why_not: str | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def name(self) -> str:
        return f"{self.stages} x {self.tp_size}"


@dataclass(frozen=True)
class MeshChoice:
    """The mesh chosen (``plan``), every mesh considered, and why."""

    mode: MeshMode
    hosts: int
    chosen: MeshOption
    considered: tuple[MeshOption, ...]
    why: str
    link: LinkKind = PLANNED_LINK

    @property
    def plan(self) -> Plan:
        assert self.chosen.plan is not None
        return self.chosen.plan


def meshes(mode: MeshMode, hosts: int) -> list[tuple[int, int]]:
    """The (P, T) that ``mode`` considers for ``hosts``, in the order it tries them."""
    if mode == "pp":
        return [(hosts, 1)]
    if mode == "tp":
        return [(1, hosts)]
    divisors = [t for t in range(1, hosts + 1) if hosts % t == 0]
    if mode == "2d":
        return [(hosts // t, t) for t in divisors if t >= 2 and hosts // t >= 2]
    return [(hosts // t, t) for t in divisors]


def choose_mesh(profile: LayerProfile, hosts: int, nodes: Sequence[PlanNode], *,
                mode: MeshMode, config: Mapping[str, Any], source: str = "config.json",
                reserve: Reserve | None = None, link: LinkKind = PLANNED_LINK) -> MeshChoice:
    """The mesh of ``hosts`` hosts (the module docstring); ``config``: the model's
    config.json (``source`` names it). Raises ``PlanRefused`` when no mesh of ``mode``
    fits, naming each one's reason."""
    reserve = Reserve() if reserve is None else reserve
    tried = meshes(mode, hosts)
    if not tried:
        raise PlanRefused(f"plan refused: a 2d mesh of {hosts} host(s) needs P x T = "
                          f"{hosts} with P >= 2 stages and T >= 2 ranks, and {hosts} has no "
                          "such factors", hint="plan 4, 6, 8 or 9 hosts for a 2d mesh, or "
                          "use --mesh pp, tp or auto")
    if mode == "pp":  # today's plans exactly, and their refusals word for word
        return pipeline_choice(plan_stages(profile, hosts, nodes, reserve=reserve), link)
    options = [_try(profile, p, t, nodes, config, source, reserve, link) for p, t in tried]
    fitting = [o for o in options if o.fits]
    if not fitting:
        raise PlanRefused(f"plan refused: no {mode} mesh of {hosts} host(s) fits: "
                          + "; ".join(f"{o.name}: {o.why_not}" for o in options),
                          hint="add hosts or memory, reserve less (a shorter context), or "
                          "try another --mesh")
    chosen, why = _pick(mode, fitting, link)
    return MeshChoice(mode, hosts, chosen, tuple(options), why, link)


def pipeline_choice(plan: Plan, link: LinkKind = PLANNED_LINK) -> MeshChoice:
    """``--mesh pp``'s choice: ``plan``, a pipeline (of one or more replica groups)."""
    only = _option(plan, link)
    return MeshChoice("pp", len(plan.stages), only, (only,), "--mesh pp: a pipeline of "
                      f"{len(plan.stages)} stage(s), no tensor groups (the default)", link)


def rank_profile(profile: LayerProfile, tp_size: int, *, head_sharded: bool) -> LayerProfile:
    """What one rank of a tensor group of ``tp_size`` holds (the module docstring)."""
    if tp_size == 1:
        return profile
    return replace(profile,
                   layer_bytes=tuple(_share(b, tp_size) for b in profile.layer_bytes),
                   head_bytes=_share(profile.head_bytes, tp_size) if head_sharded
                   else profile.head_bytes,
                   kv_bytes_per_token=_share(profile.kv_bytes_per_token, tp_size))


def plan_mesh(profile: LayerProfile, stages: int, tp_size: int, nodes: Sequence[PlanNode],
              *, head_sharded: bool, reserve: Reserve | None = None) -> Plan:
    """The plan of ``stages`` stages, each a group of ``tp_size`` ranks, over ``nodes``
    (the module docstring); raises ``PlanRefused``."""
    if tp_size == 1:
        return plan_stages(profile, stages, nodes, reserve=reserve)
    need = stages * tp_size
    ranked = rank_nodes(nodes)
    if len(ranked) < need:
        found = ", ".join(f"{n.node_id!r} ({n.key})" for n in ranked) or "none"
        raise PlanRefused(f"plan refused: {stages} x {tp_size} needs {need} peers, and "
                          f"{len(ranked)} are candidates: {found}",
                          hint="start another peer (mlxceld --pp-peer) or plan fewer hosts")
    by_memory = sorted(ranked, key=lambda n: (-n.memory_usable_bytes, n.key))
    groups = [sorted(by_memory[i:i + tp_size], key=lambda n: n.key)
              for i in range(0, need, tp_size)]
    spare = tuple(sorted(by_memory[need:], key=lambda n: n.key))
    leads = [replace(g[0], memory_usable_bytes=min(n.memory_usable_bytes for n in g),
                     compute_units=_slowest(g)) for g in groups]
    per_rank = rank_profile(profile, tp_size, head_sharded=head_sharded)
    try:
        planned = plan_stages(per_rank, stages, leads, reserve=reserve)
    except PlanRefused as exc:
        raise PlanRefused(f"{exc.message} (per rank of groups of {tp_size}: each stage's "
                          "layers and KV cache divided among its ranks, the embedding "
                          "whole on each)", hint=exc.hint, shortfalls=exc.shortfalls) from exc
    group_of = {g[0].key: g for g in groups}
    out = tuple(replace(s, node=group_of[s.node.key][0],
                        tp_nodes=tuple(group_of[s.node.key][1:])) for s in planned.stages)
    return Plan(out, planned.num_layers, planned.reserve, spare, planned.layer_bytes)


def predicted_ms(plan: Plan, link: LinkKind = PLANNED_LINK) -> float | None:
    """One token's predicted decode time through ``plan`` (the module docstring); None
    when a rank reported no compute units."""
    compute = [s.ms_per_token for s in plan.stages]
    if any(t is None for t in compute):
        return None
    cost = LINK_COSTS[link]
    allreduce = 2 * (plan.tp_size - 1) * cost.ring_step_ms
    layers = sum(s.layers[1] - s.layers[0] for s in plan.stages)
    return (sum(t for t in compute if t is not None) + 2 * layers * allreduce
            + (len(plan.stages) - 1) * cost.hop_ms)


def _try(profile: LayerProfile, stages: int, tp_size: int, nodes: Sequence[PlanNode],
         config: Mapping[str, Any], source: str, reserve: Reserve,
         link: LinkKind) -> MeshOption:
    if stages > profile.num_layers:
        return MeshOption(stages, tp_size, None, why_not=f"{stages} stages, but the model "
                          f"has {profile.num_layers} layers")
    try:
        check_tensor_parallel(config, tp_size, source=source)
    except TensorParallelRefused as exc:
        return MeshOption(stages, tp_size, None, why_not=f"the model does not split over "
                          f"{tp_size} ranks: {exc}")
    try:
        plan = plan_mesh(profile, stages, tp_size, nodes, reserve=reserve,
                         head_sharded=head_mode(config) == "shard")
    except PlanRefused as exc:
        return MeshOption(stages, tp_size, None, why_not=exc.message)
    return _option(plan, link)


def _option(plan: Plan, link: LinkKind) -> MeshOption:
    return MeshOption(len(plan.stages), plan.tp_size, plan, predicted_ms(plan, link))


def _pick(mode: MeshMode, fitting: list[MeshOption], link: LinkKind
          ) -> tuple[MeshOption, str]:
    """The option ``mode`` takes among those that fit (listed as tried), and why."""
    first = fitting[0]
    if mode == "tp":
        return first, f"--mesh tp: one stage, a tensor group of {first.tp_size} ranks"
    if mode == "2d":
        return first, (f"--mesh 2d: {first.stages} stages x {first.tp_size} ranks, the "
                       "smallest group of 2 or more that fits with 2 stages or more")
    cost = LINK_COSTS[link]
    priced = (f"each all-reduce priced at 2 (T - 1) ring steps of {cost.ring_step_ms:g} ms "
              f"over {link}, each stage hop at {cost.hop_ms:g} ms (assumed: mesh.LINK_COSTS)")
    if any(o.ms_per_token is None for o in fitting):
        pp = next((o for o in fitting if o.tp_size == 1), None)
        if pp is not None:
            return pp, ("--mesh auto: not every candidate reported compute units, so speed "
                        f"cannot be weighed: kept the pipeline ({pp.name})")
        most = max(fitting, key=lambda o: o.stages)
        return most, ("--mesh auto: not every candidate reported compute units, so speed "
                      f"cannot be weighed, and the pipeline does not fit: {most.name}, the "
                      "fitting mesh with the most stages (the fewest all-reduces)")
    best = min(fitting, key=lambda o: (o.ms_per_token or 0.0, o.tp_size))
    others = ", ".join(f"{o.name} {o.ms_per_token:.3g}" for o in fitting if o is not best)
    return best, (f"--mesh auto: {best.name} has the least predicted time per token, "
                  f"{best.ms_per_token:.3g} ms" + (f" (against {others})" if others else "")
                  + f"; {priced}")


def _share(n: int, parts: int) -> int:
    return -(-n // parts)


def _slowest(group: Sequence[PlanNode]) -> float | None:
    units = [n.compute_units for n in group]
    return None if not all(units) else min(u for u in units if u)


__all__ = ["DEFAULT_MESH", "LINK_COSTS", "MESH_MODES", "PLANNED_LINK", "LinkCost", "LinkKind",
           "MeshChoice", "MeshMode", "MeshOption", "choose_mesh", "meshes",
           "parse_mesh", "pipeline_choice", "plan_mesh", "predicted_ms", "rank_profile"]
