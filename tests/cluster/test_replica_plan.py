"""Planning replica groups: R groups of S stages over R*S candidates, group 0 first on the
nodes with the most memory; refused by name when too few fit; the plan's TOML and offers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxceld.cluster.assignment.push import push_plan
from mlxceld.cluster.clusterfile.load import dump_cluster, parse_cluster_text
from mlxceld.cluster.plan.candidates import Proposal
from mlxceld.cluster.plan.solver import (
    PlanNode,
    PlanRefused,
    Reserve,
    plan_json,
    plan_replicas,
    plan_stages,
    render_plan_table,
)
from mlxceld.models.profile import LayerProfile

MIB, GIB = 1 << 20, 1 << 30
NO_RESERVE = Reserve(context_tokens=0, activation_bytes=0)
PROFILE = LayerProfile(layer_bytes=(100 * MIB,) * 8, embed_bytes=0, head_bytes=0,
                       norm_bytes=0, other_bytes=0, tied=False, dtype_bytes=2,
                       hidden_size=1024, kv_bytes_per_token=4096)


def node(i: int, memory: int) -> PlanNode:
    return PlanNode(f"n{i}", f"10.0.0.{i}:19000", memory, 19100)


def test_groups_take_the_most_memory_first_and_each_covers_the_model() -> None:
    nodes = [node(1, 2 * GIB), node(2, 8 * GIB), node(3, 4 * GIB), node(4, 8 * GIB),
             node(5, 4 * GIB)]
    plan = plan_replicas(PROFILE, 2, 2, nodes, reserve=NO_RESERVE)
    assert (plan.replicas, plan.stages_per_replica) == (2, 2)
    assert [(s.stage_id, s.replica, s.rank, s.node.node_id) for s in plan.stages] == [
        ("stage-0", 0, 0, "n2"), ("stage-1", 0, 1, "n4"),
        ("stage-2", 1, 0, "n3"), ("stage-3", 1, 1, "n5")]
    for group in (plan.stages[:2], plan.stages[2:]):
        assert group[0].layers[0] == 0 and group[-1].layers[1] == 8
    assert [n.node_id for n in plan.spare] == ["n1"]
    cfg = plan.to_cluster("c", "m", "10.0.0.9:19000")
    assert cfg.replicas == 2 and [[n.id for n in g] for g in cfg.groups] == [
        ["stage-0", "stage-1"], ["stage-2", "stage-3"]]
    # Offers: the stage is its index among all stages, the node id stage-<index>.
    proposal = Proposal(plan, "sha256:x", "", "", ())
    assert [(o.stage, o.node_id, o.agent) for o in push_plan("c", proposal).stages] == [
        (0, "stage-0", "10.0.0.2:19000"), (1, "stage-1", "10.0.0.4:19000"),
        (2, "stage-2", "10.0.0.3:19000"), (3, "stage-3", "10.0.0.5:19000")]


def test_one_replica_is_the_plan_of_before() -> None:
    nodes = [node(i, 4 * GIB) for i in range(1, 4)]
    one = plan_replicas(PROFILE, 2, 1, nodes, reserve=NO_RESERVE)
    assert one == plan_stages(PROFILE, 2, nodes, reserve=NO_RESERVE)
    assert "REPLICA" not in render_plan_table(one)
    assert "replicas" not in plan_json(one) and "replica" not in plan_json(one)["stages"][0]


def test_report_shows_each_stage_group() -> None:
    plan = plan_replicas(PROFILE, 1, 2, [node(1, 4 * GIB), node(2, 4 * GIB)],
                         reserve=NO_RESERVE)
    table = render_plan_table(plan)
    assert table.splitlines()[0].startswith("REPLICA  STAGE")
    assert "2 replicas of 1 stage(s), each a whole copy of the model" in table
    doc = json.loads(json.dumps(plan_json(plan)))
    assert doc["replicas"] == 2 and [s["replica"] for s in doc["stages"]] == [0, 1]


def test_too_few_candidates_refused_saying_how_many_fit() -> None:
    with pytest.raises(PlanRefused) as err:
        plan_replicas(PROFILE, 2, 2, [node(i, 4 * GIB) for i in range(1, 4)])
    message = err.value.message
    assert "2 replicas of 2 stage(s) need 4 peers, and 3 are candidates" in message
    assert "'n1' (10.0.0.1:19000)" in message and "1 replica(s) would fit" in message
    assert "fewer replicas" in (err.value.hint or "")


def test_a_group_that_does_not_fit_is_named() -> None:
    """Two nodes hold the whole model (800 MiB); the other two together do not."""
    nodes = [node(1, GIB), node(2, GIB), node(3, 300 * MIB), node(4, 300 * MIB)]
    with pytest.raises(PlanRefused) as err:
        plan_replicas(PROFILE, 2, 2, nodes, reserve=NO_RESERVE)
    message = err.value.message
    assert message.startswith("plan refused: 1 of 2 replicas fit; replica 1, over the 2 "
                              "candidates left: plan refused: no split"), message
    assert err.value.shortfalls and "plan 1 replica(s)" in (err.value.hint or "")


def test_written_plan_reads_back(tmp_path: Path) -> None:
    plan = plan_replicas(PROFILE, 2, 3, [node(i, 4 * GIB) for i in range(1, 7)],
                         reserve=NO_RESERVE)
    path = tmp_path / "cluster.toml"
    cfg = plan.to_cluster("c", "m", "10.0.0.9:19000", path=path)
    again = parse_cluster_text(dump_cluster(cfg), path)
    assert again == cfg and len(again.groups) == 3
