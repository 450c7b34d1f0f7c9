"""Plans that weigh speed: the split by compute units (exact, within memory,
deterministic), the memory rule where speed says nothing, and the table that shows both."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from mlxceld.cluster.plan.report import plan_json, render_plan_table
from mlxceld.cluster.plan.solver import (
    MILLI,
    Plan,
    PlanNode,
    PlanRefused,
    Reserve,
    plan_replicas,
    plan_stages,
    split_rule,
)
from mlxceld.models.profile import LayerProfile

MIB, GIB = 1 << 20, 1 << 30
NO_RESERVE = Reserve(context_tokens=0, activation_bytes=0)


def profile(layers: int = 12, layer: int = 100 * MIB) -> LayerProfile:
    return LayerProfile(layer_bytes=(layer,) * layers, embed_bytes=0, head_bytes=0,
                        norm_bytes=0, other_bytes=0, tied=True, dtype_bytes=2,
                        hidden_size=1024, kv_bytes_per_token=4096)


def node(i: int, memory: int, units: float | None) -> PlanNode:
    return PlanNode(f"n{i}", f"10.0.0.{i}:19000", memory, 19100, units)


def counts(plan: Plan) -> list[int]:
    return [s.layers[1] - s.layers[0] for s in plan.stages]


def test_equal_speeds_give_the_memory_split() -> None:
    """Speeds that tell no node from another leave the split as memory makes it, and so
    does a node that reported none."""
    unequal_memory = [(8 * GIB, 1), (4 * GIB, 2)]
    for units in ([5.0, 5.0], [None, None], [5.0, None], [None, 9.0]):
        nodes = [node(i, m, u) for (m, i), u in zip(unequal_memory, units, strict=True)]
        bare = [node(i, m, None) for m, i in unequal_memory]
        plan = plan_stages(profile(), 2, nodes)
        assert [s.layers for s in plan.stages] == [
            s.layers for s in plan_stages(profile(), 2, bare).stages]
        assert {s.split_rule for s in plan.stages} == {"memory"}
    assert counts(plan_stages(profile(), 2, bare)) == [9, 3]  # 10.0.0.1: twice the memory


def test_more_memory_but_less_speed_gets_fewer_layers() -> None:
    """n1 has four times the memory and a third of the speed: by memory it would take 11 of
    12 layers; by speed it takes 3, and each stage's time per token is the same."""
    nodes = [node(1, 32 * GIB, 10.0), node(2, 8 * GIB, 30.0)]
    assert counts(plan_stages(profile(), 2, [node(1, 32 * GIB, None),
                                              node(2, 8 * GIB, None)])) == [11, 1]
    plan = plan_stages(profile(), 2, nodes)
    assert counts(plan) == [3, 9]
    assert {s.split_rule for s in plan.stages} == {"speed"}
    times = [s.ms_per_token for s in plan.stages]
    assert times[0] == pytest.approx(times[1])
    assert times[0] == pytest.approx(3 * 100 * MIB / (10.0 * 1e6))


def test_memory_still_bounds_a_fast_node() -> None:
    """The fastest node would take most layers, but holds only 3 with the reserve."""
    small = 3 * 100 * MIB + Reserve().stage_bytes(profile(), 3)
    plan = plan_stages(profile(), 3, [node(1, 64 * GIB, 1.0), node(2, small, 100.0),
                                      node(3, 64 * GIB, 2.0)])
    assert plan.fits and plan.stages[1].layers[1] - plan.stages[1].layers[0] == 3
    assert counts(plan) == [3, 3, 6]  # the other 9: a third and two thirds
    with pytest.raises(PlanRefused):  # and a plan that does not fit is still refused
        plan_stages(profile(layers=40), 2, [node(1, GIB, 1.0), node(2, GIB, 2.0)])


def speed_cost(p: LayerProfile, plan: Plan, reserve: Reserve,
               bounds: tuple[int, ...]) -> float | None:
    """The speed rule's cost of a split over ``plan``'s nodes; None if a load does not fit."""
    total = 0.0
    for k, s in enumerate(plan.stages):
        a, b = bounds[k], bounds[k + 1]
        size = p.weight_bytes(a, b)  # the time: weights alone; the reserve is memory
        if size + reserve.stage_bytes(p, b - a) > s.node.memory_usable_bytes:
            return None
        total += size * size / round((s.node.compute_units or 0) * MILLI)
    return total


def test_the_speed_split_is_the_exact_optimum() -> None:
    """Against every split: the least sum of weights**2 / speed among those whose loads
    (weights and reserve) fit, speeds in thousandths."""
    rng = random.Random(32)
    reserve = Reserve(context_tokens=64)
    checked = 0
    for _ in range(150):
        layers, n = rng.randint(2, 9), rng.randint(1, 3)
        n = min(n, layers)
        sizes = tuple(rng.choice([1, 2, 3, 5]) * 10 * MIB for _ in range(layers))
        p = LayerProfile(layer_bytes=sizes, embed_bytes=rng.choice([0, 20 * MIB]),
                         head_bytes=0, norm_bytes=0, other_bytes=0, tied=True, dtype_bytes=2,
                         hidden_size=64, kv_bytes_per_token=256)
        nodes = [node(i + 1, rng.choice([1, 2, 8]) * GIB, rng.choice([1.0, 2.5, 7.0]))
                 for i in range(n)]
        try:
            plan = plan_stages(p, n, nodes, reserve=reserve)
        except PlanRefused:
            continue
        if {s.split_rule for s in plan.stages} != {"speed"}:
            continue

        options = []
        for cut in itertools.combinations(range(1, layers), n - 1):
            bounds = (0, *cut, layers)
            c = speed_cost(p, plan, reserve, bounds)
            if c is not None:
                options.append((c, bounds))
        best = min(c for c, _ in options)
        got = speed_cost(p, plan, reserve, (*(s.layers[0] for s in plan.stages), layers))
        assert got is not None and got <= best * (1 + 1e-9), (sizes, nodes)
        checked += 1
    assert checked > 40, checked  # splits by speed were what was tried


def test_ties_are_deterministic_whatever_the_order_given() -> None:
    """Equal-cost splits and nodes given in any order give one plan."""
    nodes = [node(1, 16 * GIB, 2.0), node(2, 16 * GIB, 1.0), node(3, 16 * GIB, 2.0)]
    first = plan_stages(profile(layers=5), 3, nodes)
    for order in itertools.permutations(nodes):
        again = plan_stages(profile(layers=5), 3, list(order))
        assert [(s.node.key, s.layers) for s in again.stages] == [
            (s.node.key, s.layers) for s in first.stages]
    assert counts(first) == [2, 1, 2]


def test_the_rule() -> None:
    assert split_rule([node(1, GIB, 1.0), node(2, GIB, 1.5)]) == "speed"
    assert split_rule([node(1, GIB, 1.0), node(2, GIB, 1.0)]) == "memory"
    assert split_rule([node(1, GIB, 1.0), node(2, GIB, None)]) == "memory"
    assert split_rule([node(1, GIB, 3.0)]) == "memory"


def test_the_table_shows_units_time_and_rule() -> None:
    plan = plan_stages(profile(), 2, [node(1, 32 * GIB, 10.0), node(2, 8 * GIB, 30.0)])
    table = render_plan_table(plan).splitlines()
    assert table[0].split()[-2:] == ["UNITS", "MS/TOKEN"]
    assert table[1].split()[-2:] == ["10", "31.5"]  # 300 MiB at 10 GB/s
    assert table[2].split()[-2:] == ["30", "31.5"]
    assert any(line.startswith("layers split by speed (each stage's time per token")
               for line in table)
    body = plan_json(plan)
    assert json.loads(json.dumps(body)) == body
    assert [(s["compute_units"], s["split_rule"]) for s in body["stages"]] == [
        (10.0, "speed"), (30.0, "speed")]
    assert body["stages"][0]["ms_per_token"] == pytest.approx(31.45728)


def test_the_table_without_units_says_memory() -> None:
    plan = plan_stages(profile(), 2, [node(1, 8 * GIB, None), node(2, 8 * GIB, None),
                                      node(3, 4 * GIB, 2.0)])
    table = render_plan_table(plan)
    assert "UNITS" not in table.splitlines()[0]
    assert "layers split by memory (each stage's load in proportion" in table
    assert "not used: n3 (10.0.0.3:19000, 4.0 GiB usable, 2 units)" in table
    body = plan_json(plan)
    assert body["stages"][0]["compute_units"] is None
    assert body["stages"][0]["ms_per_token"] is None
    assert body["spare"][0]["compute_units"] == 2.0


def test_replica_groups_each_say_their_rule() -> None:
    nodes = [node(1, 16 * GIB, 1.0), node(2, 16 * GIB, 3.0), node(3, 8 * GIB, None),
             node(4, 8 * GIB, None)]
    plan = plan_replicas(profile(), 2, 2, nodes)
    assert [s.split_rule for s in plan.stages] == ["speed", "speed", "memory", "memory"]
    assert counts(plan)[:2] == [3, 9]
    assert ("layers split replica 0 by speed; replica 1 by memory"
            in render_plan_table(plan).splitlines())
