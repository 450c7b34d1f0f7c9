"""The pipeline planner: which node runs which contiguous layers. Pure and deterministic.

``plan_stages(profile, n, nodes, reserve=...)`` chooses the ``n`` candidates
with the most usable memory (ties by address), ranks them in lexicographic
order of their canonical ``host:port`` agent addresses (as strings: 10.0.0.10
sorts before 10.0.0.9), names them ``stage-0`` .. ``stage-(n-1)`` in that
order, and splits the layers into ``n`` contiguous, non-empty ranges in rank
order.

A stage's load is its weights (``LayerProfile.weight_bytes``: its layers, the
embeddings on the first, norm and head or the tied embeddings on the last)
plus its reserve (``Reserve``: KV cache per layer, activation slack). The
planner takes the split that minimizes the sum over stages of
``load_k ** 2 / usable_k`` among the splits where every load fits its node's
usable memory. Split continuously, that sum is least exactly when every load
is proportional to its node's usable memory (all ``load_k / usable_k``
equal), so this is the proportional split made discrete; unlike minimizing
only the largest ``load_k / usable_k``, it also balances the stages that are
not the bottleneck.

It is computed exactly, in integers: ``1 / usable_k`` is ``SCALE // usable_k``
(2**80 // usable: a relative error below 1e-9 for nodes up to 1 PiB), and a load
above its memory adds ``big * over ** 2`` with ``big`` larger than any split's
whole first term, so a fitting split always wins and, when none fits, the
result is the split with the least squared shortfall. Dynamic programming
over (stage, end layer); the cost of a stage is a convex function of the sum
of its layers' costs, so it satisfies the quadrangle inequality and the best
start of a stage never decreases as its end grows, which divide and conquer
uses: O(n * w * log w) cost evaluations for w = layers - n + 1 (about 70 000
for 100 nodes and 200 layers). Ties go to the smallest boundary, last stage
first. When the result does not fit, ``PlanRefused`` names every stage that is
short, by how much, and what to do.

**Speed.** When every chosen node reported compute units (``PlanNode.compute_units``,
``models/speed.py``: GB/s of weights through a decode-shaped matrix product) and they
are not all equal, the split weighs speed instead of memory: the sum of ``load_k ** 2 /
speed_k``, with ``speed_k`` the units in thousandths (``SCALE // speed_k`` as above),
under the same memory bound, with ``load_k`` here the stage's weights alone
(``weight_bytes``: its reserve is memory, not time). Decoding a token reads each weight
once, so a stage's time per token is about ``weights_k / speed_k``; split continuously
the sum is least when every ``weights_k / speed_k`` is equal, the bottleneck that bounds
a pipeline's tokens per second with several sequences in flight, and the stages that
are not the bottleneck are balanced as well. (The KV cache a step reads grows with the
context and is left out: it is small beside the weights at short contexts.) The nodes
are chosen and ranked as above (by memory, then by address): speed moves layers, never
which nodes run a plan, so a plan that fits by memory is still found. With equal
speeds, or a node without units (an older peer, a measurement not done or failed), the
memory rule applies: speeds that tell no node from another give no reason to leave the
proportional split, and a single sequence's time per token is then the same whatever
the split. Each stage says which
rule split its group (``PlannedStage.split_rule``).

``plan_replicas(profile, n, r, nodes)`` plans ``r`` replica groups of ``n`` stages
each, every one a whole copy of the model: group 0 is ``plan_stages`` over all the
candidates, group 1 over those group 0 left, and so on, so each group takes the
candidates with the most memory of those left. It needs ``r * n`` candidates; a group
that does not fit is refused by number, saying how many groups did fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import accumulate
from typing import Final

from mlxceld.cluster.plan.model import (
    DEFAULT_ACTIVATION_BYTES,
    DEFAULT_CONTEXT_TOKENS,
    SAFETY_FRACTION,
    Plan,
    PlannedStage,
    PlanNode,
    Reserve,
    SplitRule,
    usable_memory,
)
from mlxceld.cluster.plan.report import PlanJSON, human_bytes, plan_json, render_plan_table
from mlxceld.errors import ConfigError, PlanRefused
from mlxceld.models.profile import LayerProfile

__all__ = ["DEFAULT_ACTIVATION_BYTES", "DEFAULT_CONTEXT_TOKENS", "SAFETY_FRACTION", "SCALE",
           "Plan", "PlanJSON", "PlanNode", "PlanRefused", "PlannedStage", "Reserve",
           "human_bytes", "plan_json", "plan_replicas", "plan_stages", "rank_nodes",
           "render_plan_table",
           "split_rule", "usable_memory"]

SCALE: Final = 1 << 80  # a stage's cost weight is SCALE // its usable memory (or speed)
MILLI: Final = 1000  # compute units are weighed in thousandths

REFUSED_HINT = ("add a node and plan one more stage, free memory on the nodes named, reserve "
                "less (a shorter context), or use a smaller or quantized checkpoint")


def plan_stages(profile: LayerProfile, stages: int, nodes: Sequence[PlanNode], *,
                reserve: Reserve | None = None) -> Plan:
    """The plan of ``stages`` stages over ``nodes``; raises ``PlanRefused`` if none fits."""
    reserve = Reserve() if reserve is None else reserve
    ranked = rank_nodes(nodes)
    _check_counts(profile, stages, ranked)
    by_memory = sorted(ranked, key=lambda n: (-n.memory_usable_bytes, n.key))
    chosen = sorted(by_memory[:stages], key=lambda n: n.key)
    spare = tuple(sorted(by_memory[stages:], key=lambda n: n.key))
    per_layer = reserve.layer_bytes(profile)
    costs = [b + per_layer for b in profile.layer_bytes]
    fixed = [_fixed(profile, reserve, k, stages) for k in range(stages)]
    memory = [n.memory_usable_bytes for n in chosen]
    rule, weights = _weights(chosen)
    timed = None  # the speed rule weighs a stage's weights alone (its time), not its reserve
    if rule == "speed":
        timed = (list(profile.layer_bytes), [f - reserve.activation_bytes for f in fixed])
    bounds = _split(costs, fixed, memory, weights, timed)
    plan = _plan(profile, reserve, chosen, spare, bounds, rule)
    if not plan.fits:
        raise _refused(profile, plan)
    return plan


def plan_replicas(profile: LayerProfile, stages: int, replicas: int,
                  nodes: Sequence[PlanNode], *, reserve: Reserve | None = None) -> Plan:
    """The plan of ``replicas`` groups of ``stages`` stages over ``nodes`` (the module
    docstring); ``plan_stages`` when ``replicas`` is 1. Raises ``PlanRefused``."""
    if replicas == 1:
        return plan_stages(profile, stages, nodes, reserve=reserve)
    if replicas < 1:
        raise ConfigError(f"a plan of {replicas} replicas is empty",
                          hint="plan 1 replica or more")
    left = rank_nodes(nodes)
    _check_counts(profile, stages, left)
    if len(left) < stages * replicas:
        found = ", ".join(f"{n.node_id!r} ({n.key})" for n in left)
        raise PlanRefused(f"plan refused: {replicas} replicas of {stages} stage(s) need "
                          f"{stages * replicas} peers, and {len(left)} are candidates: "
                          f"{found}; {len(left) // stages} replica(s) would fit in number",
                          hint="start more peers (mlxceld --pp-peer), or plan fewer replicas "
                          "or fewer stages")
    groups: list[Plan] = []
    for i in range(replicas):
        try:
            group = plan_stages(profile, stages, left, reserve=reserve)
        except PlanRefused as exc:
            raise PlanRefused(f"plan refused: {i} of {replicas} replicas fit; replica {i}, "
                              f"over the {len(left)} candidates left: {exc.message}",
                              hint=f"plan {i} replica(s), or {REFUSED_HINT}",
                              shortfalls=exc.shortfalls) from exc
        groups.append(group)
        left = list(group.spare)
    planned = tuple(replace(s, replica=i, group_start=i * stages)
                    for i, g in enumerate(groups) for s in g.stages)
    first = groups[0]
    return Plan(planned, first.num_layers, first.reserve, groups[-1].spare,
                first.layer_bytes, replicas=replicas)


def rank_nodes(nodes: Sequence[PlanNode]) -> list[PlanNode]:
    """The candidates by canonical address; two at one address are refused."""
    seen: dict[str, PlanNode] = {}
    for n in nodes:
        try:
            key = n.key
        except ValueError as exc:
            raise ConfigError(f"node {n.node_id!r}: address {n.address!r} {exc}",
                              hint="a node's agent address is host:port") from exc
        if key in seen:
            raise ConfigError(f"nodes {seen[key].node_id!r} and {n.node_id!r} have the same "
                              f"address ({key})", hint="each candidate is one peer agent")
        if not 1 <= n.stage_port <= 65535:
            raise ConfigError(f"node {n.node_id!r}: stage port {n.stage_port} is outside "
                              "1-65535", hint="the peer proposes a free TCP port")
        seen[key] = n
    return [seen[k] for k in sorted(seen)]


def _check_counts(profile: LayerProfile, stages: int, nodes: list[PlanNode]) -> None:
    if stages < 1:
        raise ConfigError(f"a plan of {stages} stages is empty", hint="plan 1 stage or more")
    if stages > profile.num_layers:
        raise PlanRefused(f"plan refused: the model has {profile.num_layers} layers, fewer "
                          f"than the {stages} stages asked for (each stage runs at least one)",
                          hint=f"plan at most {profile.num_layers} stages")
    if len(nodes) < stages:
        found = ", ".join(f"{n.node_id!r} ({n.key})" for n in nodes) or "none"
        raise PlanRefused(f"plan refused: {stages} stages need {stages} peers, and "
                          f"{len(nodes)} are candidates: {found}",
                          hint="start another peer (mlxceld --pp-peer) or plan fewer stages")


def _fixed(profile: LayerProfile, reserve: Reserve, k: int, stages: int) -> int:
    """Stage k's load that does not depend on its layers."""
    first, last = k == 0, k == stages - 1
    n = profile.other_bytes + reserve.activation_bytes
    if first or (last and profile.tied):
        n += profile.embed_bytes
    if last:
        n += profile.norm_bytes + profile.head_bytes
    return n


def split_rule(nodes: Sequence[PlanNode]) -> SplitRule:
    """``speed`` when every node has compute units and they are not all equal, else
    ``memory`` (the module docstring)."""
    units = [n.compute_units for n in nodes]
    if all(units) and len(set(units)) > 1:
        return "speed"
    return "memory"


def _weights(nodes: Sequence[PlanNode]) -> tuple[SplitRule, list[int]]:
    """The rule, and each stage's cost weight: ``SCALE //`` its memory or its speed."""
    rule = split_rule(nodes)
    if rule == "speed":
        return rule, [max(1, SCALE // max(1, round((n.compute_units or 0) * MILLI)))
                      for n in nodes]
    return rule, [max(1, SCALE // max(n.memory_usable_bytes, 1)) for n in nodes]


def _split(costs: list[int], fixed: list[int], memory: list[int], weights: list[int],
           timed: tuple[list[int], list[int]] | None = None) -> list[int]:
    """Boundaries 0 = b_0 < b_1 < ... < b_n = len(costs) of the least-cost split: the sum
    over stages of ``size ** 2 * weight`` (``SCALE //`` its memory or speed), plus ``big *
    over ** 2`` for a load ``over`` bytes above its memory, ``big`` being more than any
    split's first term (every weight is at most SCALE, every size at most the total load).
    A stage's size is its load (layer ``costs`` and ``fixed``), or with ``timed`` its
    weights (each layer's, each stage's fixed): both sums over the stage's layers, so the
    cost is still convex in each and the quadrangle inequality holds for their sum."""
    n, layers = len(memory), len(costs)
    pre = [0, *accumulate(costs)]
    total = pre[-1] + sum(fixed)
    big = total * total * SCALE + 1
    tpre, tfixed = (pre, fixed) if timed is None else ([0, *accumulate(timed[0])], timed[1])
    best = [0] * (layers + 1)  # best[e]: the least cost of stages 0..k over layers [0, e)
    for e in range(1, layers - n + 2):
        best[e] = _cost(pre[e] + fixed[0], tpre[e] + tfixed[0], weights[0], memory[0], big)
    parents: list[list[int]] = []  # parents[k - 1][e]: where stage k starts if it ends at e
    for k in range(1, n):
        cur, parent = [0] * (layers + 1), [0] * (layers + 1)
        last = layers if k == n - 1 else layers - n + k + 1
        _fill(cur, parent, best, (pre, tpre), (fixed[k], tfixed[k]), weights[k], memory[k],
              big, k + 1 if k < n - 1 else layers, last, k, last - 1)
        best = cur
        parents.append(parent)
    bounds = [layers]
    for parent in reversed(parents):
        bounds.append(parent[bounds[-1]])
    bounds.append(0)
    return bounds[::-1]


def _cost(load: int, size: int, weight: int, memory: int, big: int) -> int:
    over = load - memory
    return size * size * weight + (big * over * over if over > 0 else 0)


def _fill(cur: list[int], parent: list[int], prev: list[int],
          pres: tuple[list[int], list[int]], fixed: tuple[int, int], weight: int, memory: int,
          big: int, lo: int, hi: int, slo: int, shi: int) -> None:
    """cur[e], parent[e] for ends e in [lo, hi] whose start lies in [slo, shi].

    Divide and conquer: a stage's cost is a convex function of its layers' sum, so it
    satisfies the quadrangle inequality and the smallest best start never decreases as
    the end grows; the middle end's start bounds both halves.
    """
    if lo > hi:
        return
    mid = (lo + hi) // 2
    pre, tpre = pres
    top, ttop = pre[mid] + fixed[0], tpre[mid] + fixed[1]
    least, arg = -1, slo
    for s in range(slo, min(shi, mid - 1) + 1):
        load, size = top - pre[s], ttop - tpre[s]  # _cost, inlined: the planner's time
        c = prev[s] + size * size * weight
        if load > memory:
            c += big * (load - memory) ** 2
        if least < 0 or c < least:
            least, arg = c, s
    cur[mid], parent[mid] = least, arg
    _fill(cur, parent, prev, pres, fixed, weight, memory, big, lo, mid - 1, slo, arg)
    _fill(cur, parent, prev, pres, fixed, weight, memory, big, mid + 1, hi, arg, shi)


def _plan(profile: LayerProfile, reserve: Reserve, nodes: list[PlanNode],
          spare: tuple[PlanNode, ...], bounds: list[int], rule: SplitRule) -> Plan:
    stages = tuple(
        PlannedStage(rank=k, node=node, layers=(bounds[k], bounds[k + 1]),
                     weight_bytes=profile.weight_bytes(bounds[k], bounds[k + 1]),
                     reserve_bytes=reserve.stage_bytes(profile, bounds[k + 1] - bounds[k]),
                     split_rule=rule)
        for k, node in enumerate(nodes))
    return Plan(stages, profile.num_layers, reserve, spare, profile.layer_bytes)


def _refused(profile: LayerProfile, attempt: Plan) -> PlanRefused:
    short = [s for s in attempt.stages if s.headroom_bytes < 0]
    lines = [f"{s.stage_id} on node {s.node.node_id!r} ({s.node.key}), layers "
             f"[{s.layers[0]}, {s.layers[1]}): needs {human_bytes(s.needed_bytes)} "
             f"({human_bytes(s.weight_bytes)} weights + {human_bytes(s.reserve_bytes)} "
             f"reserve), has {human_bytes(s.usable_bytes)} usable: "
             f"{human_bytes(-s.headroom_bytes)} short" for s in short]
    needed = sum(s.needed_bytes for s in attempt.stages)
    usable = sum(s.usable_bytes for s in attempt.stages)
    message = (f"plan refused: no split of {profile.num_layers} layers over "
               f"{len(attempt.stages)} stages fits; they need {human_bytes(needed)} in all and "
               f"the nodes offer {human_bytes(usable)}. Closest split: " + "; ".join(lines))
    shortfalls = tuple(_shortfall(s) for s in short)
    return PlanRefused(message, hint=REFUSED_HINT, shortfalls=shortfalls)


def _shortfall(s: PlannedStage) -> dict[str, str | int]:
    return {"stage": s.stage_id, "node_id": s.node.node_id, "address": s.node.key,
            "needed_bytes": s.needed_bytes, "usable_bytes": s.usable_bytes,
            "short_bytes": -s.headroom_bytes}
