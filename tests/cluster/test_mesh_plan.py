"""The mesh planner (cluster/plan/mesh.py): P stages x T ranks over N hosts, each rank's
memory, the predicted time per token, the choice of each mode and its 2D cluster TOML."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from mlxceld.cluster.assignment.push import push_plan
from mlxceld.cluster.clusterfile.load import parse_cluster_text
from mlxceld.cluster.plan.candidates import drafted, make_plan
from mlxceld.cluster.plan.mesh import (
    LINK_COSTS,
    MeshChoice,
    choose_mesh,
    meshes,
    parse_mesh,
    plan_mesh,
    predicted_ms,
    rank_profile,
)
from mlxceld.cluster.plan.mesh_report import mesh_json, render_mesh
from mlxceld.cluster.plan.model import Plan, PlannedStage
from mlxceld.cluster.plan.report import plan_json, render_plan_table
from mlxceld.cluster.plan.solver import PlanNode, PlanRefused, Reserve, plan_stages
from mlxceld.errors import ConfigError
from mlxceld.models.profile import LayerProfile, layer_profile
from mlxceld.state.peers import PeerRow

MIB, GIB = 1 << 20, 1 << 30
NO_RESERVE = Reserve(context_tokens=0, activation_bytes=0)
LLAMA = {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 4,
         "intermediate_size": 256}


def profile(layers: int = 8, layer: int = 100 * MIB, embed: int = 40 * MIB,
            head: int = 40 * MIB) -> LayerProfile:
    return LayerProfile(layer_bytes=(layer,) * layers, embed_bytes=embed, head_bytes=head,
                        norm_bytes=1 * MIB, other_bytes=0, tied=False, dtype_bytes=2,
                        hidden_size=1024, kv_bytes_per_token=4096)


def node(i: int, memory: int = 8 * GIB, units: float | None = None) -> PlanNode:
    return PlanNode(f"n{i}", f"10.0.0.{i}:19000", memory, 19100 + i, units)


def choose(n: int, nodes: list[PlanNode], mode: str, config: dict[str, object] = LLAMA,
           reserve: Reserve = NO_RESERVE, prof: LayerProfile | None = None) -> MeshChoice:
    return choose_mesh(prof or profile(), n, nodes, mode=parse_mesh(mode, "--mesh"),
                       config=config, reserve=reserve)


def test_modes_and_their_meshes() -> None:
    assert meshes("pp", 4) == [(4, 1)]
    assert meshes("tp", 4) == [(1, 4)]
    assert meshes("2d", 4) == [(2, 2)]
    assert meshes("2d", 6) == [(3, 2), (2, 3)]  # T = 2 first when N is even
    assert meshes("2d", 9) == [(3, 3)]  # N odd: the smallest odd divisor
    assert meshes("2d", 5) == [] and meshes("2d", 3) == [] and meshes("2d", 2) == []
    assert meshes("auto", 4) == [(4, 1), (2, 2), (1, 4)]
    with pytest.raises(ValueError, match="--mesh 'ring' is not a mesh: give one of pp, tp, "
                       "2d, auto"):
        parse_mesh("ring", "--mesh")


def test_pp_is_the_pipeline_plan_unchanged() -> None:
    nodes = [node(1, 8 * GIB), node(2, 4 * GIB), node(3, 2 * GIB)]
    choice = choose(3, nodes, "pp", reserve=Reserve())
    plain = plan_stages(profile(), 3, nodes)
    assert choice.plan == plain and choice.plan.tp_size == 1
    assert plan_json(choice.plan) == plan_json(plain)
    assert [o.name for o in choice.considered] == ["3 x 1"]


def test_a_rank_holds_a_share_of_the_layers_and_the_embedding_whole() -> None:
    """tp 2 over two hosts: each rank holds half of every layer and of the KV cache, and the
    embedding, head (llama: mlx-lm keeps it whole) and norm whole."""
    reserve = Reserve(context_tokens=1000, activation_bytes=7 * MIB)
    plan = choose(2, [node(2), node(1)], "tp", reserve=reserve).plan
    (stage,) = plan.stages
    assert plan.tp_size == 2 and stage.node.node_id == "n1"
    assert [n.node_id for n in stage.tp_nodes] == ["n2"]
    assert stage.weight_bytes == 8 * 50 * MIB + 40 * MIB + 40 * MIB + MIB
    assert stage.reserve_bytes == 8 * 1000 * 2048 + 7 * MIB
    # qwen3.5 with its own head: mlx-lm cuts the head by vocabulary, so it is shared too
    qwen = {**LLAMA, "model_type": "qwen3_5", "tie_word_embeddings": False}
    cut = choose(2, [node(1), node(2)], "tp", config=qwen).plan.stages[0]
    assert cut.weight_bytes == 8 * 50 * MIB + 40 * MIB + 20 * MIB + MIB
    assert rank_profile(profile(), 1, head_sharded=True) == profile()


def test_fits_counts_every_rank() -> None:
    """The tightest rank decides: a group whose rank 1 is short does not fit, and the plan
    that would need it is refused naming the per-rank rule."""
    prof = profile()
    need = plan_mesh(prof, 1, 2, [node(1), node(2)], head_sharded=False,
                     reserve=NO_RESERVE).stages[0].needed_bytes
    small = node(2, need - 1)
    stage = PlannedStage(0, node(1), (0, 8), need, 0, tp_nodes=(small,))
    assert Plan((stage,), 8, NO_RESERVE).fits is False
    assert stage.usable_bytes == need - 1 and stage.headroom_bytes == -1
    with pytest.raises(PlanRefused, match="per rank of groups of 2"):
        plan_mesh(prof, 1, 2, [node(1), small], head_sharded=False, reserve=NO_RESERVE)


def test_groups_take_hosts_of_like_memory_together() -> None:
    """2 x 2 over hosts of 8, 8, 2 and 2 GiB: the big two form one group, the small two the
    other (a group is as big as its smallest rank), so the big group takes more layers."""
    nodes = [node(1, 8 * GIB), node(2, 2 * GIB), node(3, 8 * GIB), node(4, 2 * GIB),
             node(5, 1 * GIB)]
    plan = choose(4, nodes, "2d").plan
    assert [[n.node_id for n in s.ranks] for s in plan.stages] == [["n1", "n3"],
                                                                   ["n2", "n4"]]
    assert [n.node_id for n in plan.spare] == ["n5"]
    sizes = [s.layers[1] - s.layers[0] for s in plan.stages]
    assert sizes[0] > sizes[1] and sum(sizes) == 8


def test_2d_takes_the_next_group_size_when_the_model_does_not_split() -> None:
    """Six hosts, a model of 9 heads: T = 2 does not divide them, so 2d is 2 x 3."""
    nine = {**LLAMA, "num_attention_heads": 9, "num_key_value_heads": 3,
            "intermediate_size": 9 * 64}
    choice = choose(6, [node(i) for i in range(1, 7)], "2d", config=nine)
    assert (choice.chosen.stages, choice.chosen.tp_size) == (2, 3)
    (three_by_two,) = [o for o in choice.considered if o.tp_size == 2]
    assert not three_by_two.fits and "does not divide num_attention_heads 9" in str(
        three_by_two.why_not)
    with pytest.raises(PlanRefused, match="a 2d mesh of 5 host"):
        choose(5, [node(i) for i in range(1, 7)], "2d")


def test_predicted_time_adds_all_reduces_and_hops() -> None:
    """Compute over the slowest rank, two all-reduces of 2 (T - 1) ring steps per layer,
    a hop per stage boundary."""
    nodes = [node(1, units=10.0), node(2, units=5.0), node(3, units=10.0),
             node(4, units=10.0)]
    plan = plan_mesh(profile(), 2, 2, nodes, head_sharded=False, reserve=NO_RESERVE)
    cost = LINK_COSTS["tcp"]
    compute = sum(s.weight_bytes / (min(n.compute_units or 0 for n in s.ranks) * 1e6)
                  for s in plan.stages)
    want = compute + 2 * 8 * (2 * cost.ring_step_ms) + cost.hop_ms
    assert predicted_ms(plan) == pytest.approx(want)
    assert predicted_ms(plan_mesh(profile(), 2, 2, [node(i) for i in range(1, 5)],
                                  head_sharded=False)) is None


def test_auto_takes_the_least_predicted_time() -> None:
    """Slow hosts (compute dominates): tp over all four beats the pipeline, whose stages
    run one after the other; fast hosts (all-reduces dominate): the pipeline wins."""
    slow = choose(4, [node(i, units=0.5) for i in range(1, 5)], "auto")
    assert [o.name for o in slow.considered] == ["4 x 1", "2 x 2", "1 x 4"]
    assert all(o.fits and o.ms_per_token is not None for o in slow.considered)
    best = min(slow.considered, key=lambda o: o.ms_per_token or 0.0)
    assert slow.chosen is best and best.tp_size == 4
    assert "least predicted time" in slow.why and "tcp" in slow.why
    fast = choose(4, [node(i, units=500.0) for i in range(1, 5)], "auto")
    assert fast.chosen.tp_size == 1 and fast.plan.tp_size == 1


def test_auto_without_units_keeps_the_pipeline() -> None:
    choice = choose(4, [node(i) for i in range(1, 5)], "auto")
    assert choice.chosen.tp_size == 1 and "cannot be weighed" in choice.why
    assert all(o.ms_per_token is None for o in choice.considered)
    # three layers do not split evenly over a pipeline of 2, but each rank of tp 2 holds
    # half of each: then the fitting mesh with the most stages
    prof = profile(layers=3, layer=2 * GIB, embed=GIB // 4, head=GIB // 4)
    small = [node(1, 4 * GIB), node(2, 4 * GIB)]
    with pytest.raises(PlanRefused):
        plan_stages(prof, 2, small, reserve=NO_RESERVE)
    fallback = choose(2, small, "auto", prof=prof)
    assert fallback.chosen.name == "1 x 2" and "does not fit" in fallback.why


def test_a_mesh_that_fits_nowhere_is_refused_naming_each() -> None:
    prof = profile(layers=2, layer=30 * GIB)
    with pytest.raises(PlanRefused) as err:
        choose(4, [node(i, 1 * GIB) for i in range(1, 5)], "auto", prof=prof)
    assert "4 x 1: 4 stages, but the model has 2 layers" in err.value.message
    assert "2 x 2: plan refused" in err.value.message and "1 x 4:" in err.value.message


def test_the_table_and_json_show_groups_and_the_mesh() -> None:
    choice = choose(4, [node(i, units=1.0) for i in range(1, 5)], "2d")
    table = render_plan_table(choice.plan)
    assert table.splitlines()[0].split()[:4] == ["STAGE", "NODE", "TP", "ADDRESS"]
    assert "each stage a tensor group of 2 ranks" in table
    body = plan_json(choice.plan)
    assert body["tp_size"] == 2
    assert [[r["node_id"] for r in s.get("tp_nodes", [])] for s in body["stages"]] == [
        ["n2"], ["n4"]]
    mesh = mesh_json(choice)
    assert (mesh["mode"], mesh["stages"], mesh["tp_size"]) == ("2d", 2, 2)
    assert [o["chosen"] for o in mesh["considered"]] == [True]
    assert json.loads(json.dumps(mesh)) == mesh
    text = render_mesh(choice)
    assert "2 x 2" in text and "chosen" in text and text.endswith(choice.why)


def test_cluster_text_of_a_2d_plan() -> None:
    """The 2D cluster TOML (mlxcel-cluster.toml(5)): each stage's rank 0 at its stage
    listener, its other ranks at their agent addresses, all with the stage's layers."""
    plan = choose(4, [node(i) for i in range(1, 5)], "2d").plan
    text = plan.cluster_text("mesh", "model-dir", "10.0.0.9:19000")
    data = tomllib.loads(text)
    assert data["cluster"] == {"name": "mesh", "pipeline_parallel_size": 2,
                               "tensor_parallel_size": 2, "model": "model-dir"}
    rows = [(n["id"], n["address"], n["role"], n.get("layers"), n.get("rank"))
            for n in data["nodes"]]
    (a, b), (c, d) = [s.layers for s in plan.stages]
    assert rows == [
        ("coordinator", "10.0.0.9:19000", "coordinator", None, None),
        ("stage-0", "10.0.0.1:19101", "pipeline_tensor_parallel", [a, b], 0),
        ("stage-0-tp-1", "10.0.0.2:19000", "pipeline_tensor_parallel", [a, b], 1),
        ("stage-1", "10.0.0.3:19103", "pipeline_tensor_parallel", [c, d], 0),
        ("stage-1-tp-1", "10.0.0.4:19000", "pipeline_tensor_parallel", [c, d], 1)]
    assert data["nodes"][2]["resources"] == {"memory_bytes": 8 * GIB}


def test_make_plan_with_a_mesh_over_a_real_checkpoint(fixture_dir: Path) -> None:
    """The llama fixture over four peers: ``--mesh 2d`` gives 2 x 2 priced from its own
    headers and config.json, its table and JSON show the mesh, its TOML reads back as a 2D
    mesh's and the push offers each rank with its group; ``--mesh pp`` is today's plan,
    word for word."""
    model = fixture_dir / "llama"

    def peer(i: int) -> PeerRow:
        return PeerRow(address=f"127.0.0.{i}:19000", source="static", state="reachable",
                       updated_at=1.0, node_id=f"h{i}", memory_total=64 * GIB,
                       memory_available=32 * GIB,
                       inventory={"ports": [19100 + i], "model": None,
                                  "compute_units": 2.0})

    peers = [peer(i) for i in range(2, 6)]
    whole = layer_profile(model)
    mesh = make_plan(peers, model, 4, cluster="lab", coordinator="127.0.0.1:19000",
                     mesh="2d")
    assert (len(mesh.plan.stages), mesh.plan.tp_size) == (2, 2)
    first = mesh.plan.stages[0]
    a, b = first.layers
    assert first.weight_bytes < whole.weight_bytes(a, b)  # each rank holds a share
    assert "meshes of 4 host(s) considered (--mesh 2d)" in mesh.table
    shown = json.loads(json.dumps(mesh.to_json()))
    assert shown["mesh"]["stages"] == 2 and shown["mesh"]["tp_size"] == 2
    assert shown["plan"]["tp_size"] == 2
    assert tomllib.loads(mesh.toml)["cluster"]["tensor_parallel_size"] == 2
    # the push offers every rank, each with its stage's group in rank order
    offers = push_plan("lab", mesh).stages
    assert [(o.agent, o.node_id, o.stage, o.tp_rank, o.port) for o in offers] == [
        ("127.0.0.2:19000", "stage-0", 0, 0, 19102), ("127.0.0.3:19000", "stage-0-tp-1", 0, 1, 0),
        ("127.0.0.4:19000", "stage-1", 1, 0, 19104), ("127.0.0.5:19000", "stage-1-tp-1", 1, 1, 0)]
    assert {o.tp_group for o in offers} == {("127.0.0.2:19000", "127.0.0.3:19000"),
                                            ("127.0.0.4:19000", "127.0.0.5:19000")}
    cfg = mesh.plan.to_cluster("lab", str(model), "127.0.0.1:19000")
    assert cfg.mesh and [n.id for n in cfg.stages] == ["stage-0", "stage-1"]
    auto = make_plan(peers, model, 4, cluster="lab", coordinator="127.0.0.1:19000",
                     mesh="auto")
    assert {(o.stages, o.tp_size) for o in auto.mesh.considered} == {(4, 1), (2, 2), (1, 4)}
    assert auto.mesh.chosen in auto.mesh.considered and auto.mesh.why
    pp = make_plan(peers[:2], model, 2, cluster="lab", coordinator="127.0.0.1:19000")
    before = make_plan(peers[:2], model, 2, cluster="lab", coordinator="127.0.0.1:19000",
                       mesh="pp")
    assert pp.table == before.table and "meshes" not in pp.table
    assert pp.to_json()["mesh"]["considered"][0]["chosen"] is True
    assert all(not o.tp_group for o in push_plan("lab", pp).stages)
    with pytest.raises(ConfigError, match="--mesh tp with 2 replicas is not built"):
        make_plan(peers, model, 2, cluster="lab", coordinator="127.0.0.1:19000",
                  mesh="tp", replicas=2)


def test_a_draft_goes_into_a_plan_of_tensor_parallel_stages(fixture_dir: Path) -> None:
    """Speculation runs on a pipeline's last stage, in a mesh its tensor group's rank 0
    (``pipeline/tensor_stage.py``): ``[serve] draft_model`` goes into the plan's TOML,
    a mesh's as a pipeline's, and the last stage's rank 0 is placed with it."""
    model = fixture_dir / "llama"
    peers = [PeerRow(address=f"127.0.0.{i}:19000", source="static", state="reachable",
                     updated_at=1.0, node_id=f"h{i}", memory_total=64 * GIB,
                     memory_available=32 * GIB,
                     inventory={"ports": [19100 + i], "model": None, "compute_units": 2.0})
             for i in range(2, 6)]
    mesh = make_plan(peers, model, 4, cluster="lab", coordinator="127.0.0.1:19000",
                     mesh="2d")
    for proposal in (mesh, make_plan(peers, model, 2, cluster="lab",
                                     coordinator="127.0.0.1:19000")):
        text = drafted(proposal, ("draft-dir", 4)).toml
        toml = tomllib.loads(text)["cluster"]
        assert (toml["draft_model"], toml["num_draft_tokens"]) == ("draft-dir", 4)
        assert drafted(proposal, (None, 4)).toml == proposal.toml
    cfg = parse_cluster_text(drafted(mesh, ("draft-dir", 3)).toml, Path("/c/cluster.toml"))
    assert cfg.mesh and (cfg.draft_model, cfg.num_draft_tokens) == ("draft-dir", 3)
