"""Re-planning replica groups around a lost host (``plan/groups.py``): the groups whose
hosts are all left keep them, a group that lost one is re-planned over the spares, or
dropped when none fits; a kept group that does not fit beside its running stages, or no
group left, is refused by name."""

from __future__ import annotations

import pytest

from mlxceld.cluster.plan.groups import plan_groups_around
from mlxceld.cluster.plan.solver import PlanNode, PlanRefused, Reserve
from mlxceld.models.profile import LayerProfile

MIB, GIB = 1 << 20, 1 << 30
NO_RESERVE = Reserve(context_tokens=0, activation_bytes=0)
PROFILE = LayerProfile(layer_bytes=(100 * MIB,) * 8, embed_bytes=0, head_bytes=0,
                       norm_bytes=0, other_bytes=0, tied=False, dtype_bytes=2,
                       hidden_size=1024, kv_bytes_per_token=4096)


def node(i: int, memory: int = 8 * GIB) -> PlanNode:
    return PlanNode(f"n{i}", f"10.0.0.{i}:19000", memory, 19100)


def addr(i: int) -> str:
    return f"10.0.0.{i}:19000"


def test_the_group_that_lost_a_host_moves_to_the_spare_and_the_other_keeps_its_hosts(
        ) -> None:
    groups = [(addr(1), addr(2)), (addr(3), addr(4))]
    # n3 is gone (dead or drained); n5 is a spare with the most memory, n6 a smaller one.
    nodes = [node(1), node(2), node(4), node(5, 16 * GIB), node(6, 4 * GIB)]
    plan, notes = plan_groups_around(PROFILE, groups, nodes, reserve=NO_RESERVE)
    assert plan.replicas == 2 and plan.stages_per_replica == 2
    assert [(s.stage_id, s.replica, s.rank, s.node.node_id) for s in plan.stages] == [
        ("stage-0", 0, 0, "n1"), ("stage-1", 0, 1, "n2"),
        ("stage-2", 1, 0, "n4"), ("stage-3", 1, 1, "n5")]  # n4 survived: its group's again
    for group in (plan.stages[:2], plan.stages[2:]):
        assert group[0].layers[0] == 0 and group[-1].layers[1] == 8
    assert [n.node_id for n in plan.spare] == ["n6"]
    assert notes == ["replica group 1 lost 10.0.0.3:19000: re-planned on 10.0.0.4:19000, "
                     "10.0.0.5:19000"]
    cfg = plan.to_cluster("c", "m", "10.0.0.9:19000")
    assert [[n.id for n in g] for g in cfg.groups] == [["stage-0", "stage-1"],
                                                       ["stage-2", "stage-3"]]


def test_without_a_spare_the_group_is_dropped_and_one_group_is_a_plain_pipeline() -> None:
    groups = [(addr(1),), (addr(2),)]
    plan, notes = plan_groups_around(PROFILE, groups, [node(2)], reserve=NO_RESERVE)
    assert plan.replicas == 1
    assert [(s.stage_id, s.replica, s.node.node_id, s.layers) for s in plan.stages] == [
        ("stage-0", 0, "n2", (0, 8))]
    assert len(notes) == 1 and notes[0].startswith(
        "replica group 0 lost 10.0.0.1:19000 and does not fit over the hosts left"), notes
    assert "dropped, the plan has one group fewer" in notes[0]
    cfg = plan.to_cluster("c", "m", "10.0.0.9:19000")
    assert cfg.replicas == 1


def test_a_spare_too_small_drops_the_group_too() -> None:
    groups = [(addr(1),), (addr(2),), (addr(3),)]
    nodes = [node(1), node(3), node(4, 100 * MIB)]  # 800 MiB do not fit in n4
    plan, notes = plan_groups_around(PROFILE, groups, nodes, reserve=NO_RESERVE)
    assert plan.replicas == 2
    assert [s.node.node_id for s in plan.stages] == ["n1", "n3"]
    assert [s.stage_id for s in plan.stages] == ["stage-0", "stage-1"]
    assert "replica group 1 lost 10.0.0.2:19000" in notes[0] and "dropped" in notes[0]


def test_a_kept_group_short_of_memory_or_no_group_left_is_refused() -> None:
    groups = [(addr(1),), (addr(2),)]
    with pytest.raises(PlanRefused, match=r"replica group 0 \(10.0.0.1:19000\) does not fit "
                       "beside its running stages"):
        plan_groups_around(PROFILE, groups, [node(1, 100 * MIB), node(3)],
                           reserve=NO_RESERVE)
    with pytest.raises(PlanRefused, match="no replica group fits over the hosts left"):
        plan_groups_around(PROFILE, groups, [node(3, 100 * MIB)], reserve=NO_RESERVE)
