"""The pipeline planner: proportional, deterministic, exact, and refusing what cannot fit."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from mlxceld.cluster.assignment.push import push_plan
from mlxceld.cluster.clusterfile.load import (
    dump_cluster,
    load_cluster,
    parse_cluster_text,
    validate_layers,
    write_cluster,
)
from mlxceld.cluster.clusterfile.placement import place
from mlxceld.cluster.plan.candidates import make_plan
from mlxceld.cluster.plan.report import layer_runs
from mlxceld.cluster.plan.solver import (
    SCALE,
    Plan,
    PlanNode,
    PlanRefused,
    Reserve,
    human_bytes,
    plan_json,
    plan_stages,
    render_plan_table,
    usable_memory,
)
from mlxceld.errors import ConfigError
from mlxceld.models import layer_profile, model_identity
from mlxceld.models.profile import LayerProfile
from mlxceld.state.peers import PeerRow

MIB, GIB = 1 << 20, 1 << 30
NO_RESERVE = Reserve(context_tokens=0, activation_bytes=0)


def profile(layers: int = 8, layer: int = 100 * MIB, embed: int = 0, head: int = 0,
            tied: bool = False, kv: int = 4096) -> LayerProfile:
    return LayerProfile(layer_bytes=(layer,) * layers, embed_bytes=embed, head_bytes=head,
                        norm_bytes=0, other_bytes=0, tied=tied, dtype_bytes=2,
                        hidden_size=1024, kv_bytes_per_token=kv)


def node(i: int, memory: int, port: int = 19100, name: str | None = None) -> PlanNode:
    return PlanNode(name or f"n{i}", f"10.0.0.{i}:19000", memory, port)


def layer_counts(plan: Plan) -> list[int]:
    return [s.layers[1] - s.layers[0] for s in plan.stages]


def test_equal_nodes_split_evenly() -> None:
    plan = plan_stages(profile(layers=16), 4, [node(i, 8 * GIB) for i in range(1, 5)],
                       reserve=NO_RESERVE)
    assert [s.layers for s in plan.stages] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert len({s.headroom_bytes for s in plan.stages}) == 1


def test_embeddings_and_head_count_on_the_end_stages() -> None:
    """Embeddings and head of 2 layers each: the end stages take 2 layers fewer."""
    p = profile(layers=23, embed=200 * MIB, head=200 * MIB)
    plan = plan_stages(p, 3, [node(i, 8 * GIB) for i in range(1, 4)], reserve=NO_RESERVE)
    assert layer_counts(plan) == [7, 9, 7]
    assert {s.weight_bytes for s in plan.stages} == {900 * MIB}
    tied = plan_stages(profile(layers=23, embed=200 * MIB, tied=True), 3,
                       [node(i, 8 * GIB) for i in range(1, 4)], reserve=NO_RESERVE)
    assert layer_counts(tied) == [7, 9, 7]  # the tied embeddings are the last stage's head


def test_heterogeneous_nodes_split_by_memory() -> None:
    """64 GiB and 16 GiB: about 4:1, in layers and in load."""
    nodes = [node(1, 64 * GIB), node(2, 16 * GIB)]
    plan = plan_stages(profile(layers=200), 2, nodes)
    big, small = plan.stages
    assert (big.node.node_id, small.node.node_id) == ("n1", "n2")
    assert 3.8 < big.needed_bytes / small.needed_bytes < 4.2
    assert 3.8 < layer_counts(plan)[0] / layer_counts(plan)[1] < 4.6
    # The order follows the addresses, not the memory: the small node first.
    flipped = plan_stages(profile(layers=200), 2, [node(1, 16 * GIB), node(2, 64 * GIB)])
    assert 3.8 < flipped.stages[1].needed_bytes / flipped.stages[0].needed_bytes < 4.2


def test_many_nodes_are_each_loaded_in_proportion() -> None:
    nodes = [node(i, (8 + 8 * (i % 4)) * GIB) for i in range(1, 9)]
    plan = plan_stages(profile(layers=120), 8, nodes, reserve=NO_RESERVE)
    ratios = [s.needed_bytes / s.node.memory_usable_bytes for s in plan.stages]
    assert max(ratios) - min(ratios) < 0.06, ratios


def test_reserve_counts_kv_cache_per_layer_and_activations() -> None:
    reserve = Reserve(context_tokens=1000, activation_bytes=7 * MIB)
    plan = plan_stages(profile(layers=8, kv=2048), 2, [node(1, 8 * GIB), node(2, 8 * GIB)],
                       reserve=reserve)
    for s in plan.stages:
        layers = s.layers[1] - s.layers[0]
        assert s.reserve_bytes == layers * 1000 * 2048 + 7 * MIB
        assert s.headroom_bytes == 8 * GIB - s.weight_bytes - s.reserve_bytes


def test_deterministic_whatever_the_input_order() -> None:
    nodes = [node(i, (4 + i % 5) * GIB, port=19100 + i) for i in range(1, 13)]
    p = profile(layers=40, embed=300 * MIB, head=300 * MIB)
    first = plan_stages(p, 6, nodes)
    rng = random.Random(7)
    for _ in range(10):
        shuffled = nodes[:]
        rng.shuffle(shuffled)
        again = plan_stages(p, 6, shuffled)
        assert again == first
        assert json.dumps(plan_json(again)) == json.dumps(plan_json(first))


def test_stages_are_named_in_lexicographic_order_of_canonical_addresses() -> None:
    nodes = [PlanNode("nine", "10.0.0.9:19000", 8 * GIB, 19101),
             PlanNode("ten", "10.0.0.10:19000", 8 * GIB, 19102),
             PlanNode("mapped", "[::ffff:10.0.0.2]:19000", 8 * GIB, 19103),
             PlanNode("host", "Peer-A.local.:19000", 8 * GIB, 19104)]
    plan = plan_stages(profile(layers=8), 4, nodes)
    assert [(s.stage_id, s.node.node_id, s.address) for s in plan.stages] == [
        ("stage-0", "ten", "10.0.0.10:19102"),
        ("stage-1", "mapped", "10.0.0.2:19103"),
        ("stage-2", "nine", "10.0.0.9:19101"),
        ("stage-3", "host", "peer-a.local:19104")]
    v6 = plan_stages(profile(), 1, [PlanNode("v6", "[fd00::0:1]:19000", 8 * GIB, 19100)])
    assert v6.stages[0].address == "[fd00::1]:19100"


def test_the_nodes_with_the_most_memory_are_chosen() -> None:
    nodes = [node(1, 8 * GIB), node(2, 32 * GIB), node(3, 16 * GIB), node(4, 16 * GIB)]
    plan = plan_stages(profile(), 2, nodes)
    assert [s.node.node_id for s in plan.stages] == ["n2", "n3"]  # n3 before n4: address
    assert [n.node_id for n in plan.spare] == ["n1", "n4"]
    assert "not used: n1 (10.0.0.1:19000, 8.0 GiB usable), n4" in render_plan_table(plan)


def test_nodes_tied_on_memory_are_chosen_by_address_alone() -> None:
    """Ties by canonical address as a string (10.0.0.10 before 10.0.0.9), never by name or
    by the order they came in."""
    nodes = [PlanNode("a-nine", "10.0.0.9:19000", 16 * GIB, 19101),
             PlanNode("z-ten", "10.0.0.10:19000", 16 * GIB, 19102),
             PlanNode("m-big", "10.0.0.7:19000", 32 * GIB, 19103),
             PlanNode("b-two", "[::ffff:10.0.0.2]:19000", 8 * GIB, 19104)]
    for order in (nodes, nodes[::-1]):
        plan = plan_stages(profile(), 2, order)
        assert [s.node.node_id for s in plan.stages] == ["z-ten", "m-big"]
        assert [n.node_id for n in plan.spare] == ["b-two", "a-nine"]


def test_refusal_names_every_node_that_is_short() -> None:
    nodes = [node(1, 2 * GIB), node(2, 1 * GIB), node(3, 3 * GIB)]
    with pytest.raises(PlanRefused) as info:
        plan_stages(profile(layers=70), 3, nodes, reserve=NO_RESERVE)
    exc = info.value
    assert exc.code == "plan_refused"
    assert "no split of 70 layers over 3 stages fits; they need 6.8 GiB in all and the " \
        "nodes offer 6.0 GiB" in exc.message
    for n in ("'n1' (10.0.0.1:19000)", "'n2' (10.0.0.2:19000)", "'n3' (10.0.0.3:19000)"):
        assert n in exc.message
    assert [s["node_id"] for s in exc.shortfalls] == ["n1", "n2", "n3"]
    for s in exc.shortfalls:
        assert s["short_bytes"] == s["needed_bytes"] - s["usable_bytes"]
        assert f"{human_bytes(s['short_bytes'])} short" in exc.message
    assert "add a node" in exc.hint


def test_refusal_names_only_the_node_that_cannot_hold_its_part() -> None:
    """Plenty of memory in all, but the last node cannot hold the 2 GiB head."""
    nodes = [node(1, 100 * GIB), node(2, 1 * GIB)]
    with pytest.raises(PlanRefused) as info:
        plan_stages(profile(head=2 * GIB), 2, nodes, reserve=NO_RESERVE)
    assert [s["node_id"] for s in info.value.shortfalls] == ["n2"]
    assert "stage-1 on node 'n2'" in info.value.message and "'n1'" not in info.value.message
    assert "layers [7, 8): needs 2.1 GiB" in info.value.message
    assert "1.0 GiB usable: 1.1 GiB short" in info.value.message


def test_too_few_nodes_or_layers() -> None:
    with pytest.raises(PlanRefused, match=r"3 stages need 3 peers, and 2 are candidates: "
                       r"'n1' \(10\.0\.0\.1:19000\), 'n2'") as info:
        plan_stages(profile(), 3, [node(1, GIB), node(2, GIB)])
    assert "--pp-peer" in info.value.hint and info.value.shortfalls == ()
    with pytest.raises(PlanRefused, match="has 8 layers, fewer than the 9 stages"):
        plan_stages(profile(), 9, [node(i, GIB) for i in range(1, 10)])
    with pytest.raises(ConfigError, match="0 stages"):
        plan_stages(profile(), 0, [node(1, GIB)])


def test_bad_candidates_are_refused() -> None:
    with pytest.raises(ConfigError, match="'a' and 'b' have the same address"):
        plan_stages(profile(), 1, [PlanNode("a", "10.0.0.1:19000", GIB, 19100),
                                   PlanNode("b", "[::ffff:10.0.0.1]:19000", GIB, 19100)])
    with pytest.raises(ConfigError, match="'a': address 'nowhere' has no ':port'"):
        plan_stages(profile(), 1, [PlanNode("a", "nowhere", GIB, 19100)])
    with pytest.raises(ConfigError, match="stage port 0"):
        plan_stages(profile(), 1, [PlanNode("a", "10.0.0.1:19000", GIB, 0)])


def brute_force(p: LayerProfile, reserve: Reserve, memory: list[int]) -> int | None:
    """The least sum of load^2 * (SCALE // memory) over the splits that fit, or None."""
    best = None
    for cut in itertools.combinations(range(1, p.num_layers), len(memory) - 1):
        bounds = [0, *cut, p.num_layers]
        loads = [p.weight_bytes(s, e) + reserve.stage_bytes(p, e - s)
                 for s, e in itertools.pairwise(bounds)]
        if all(load <= m for load, m in zip(loads, memory, strict=True)):
            value = sum(load * load * (SCALE // m) for load, m in zip(loads, memory,
                                                                       strict=True))
            best = value if best is None else min(best, value)
    return best


def test_the_split_is_the_exact_optimum() -> None:
    """Against every split of small random models over random nodes."""
    rng = random.Random(2024)
    refused = 0
    for _ in range(400):
        layers = rng.randint(1, 9)
        stages = rng.randint(1, layers)
        p = LayerProfile(layer_bytes=tuple(rng.randint(1, 50) for _ in range(layers)),
                         embed_bytes=rng.randint(0, 60), head_bytes=rng.randint(0, 60),
                         norm_bytes=rng.randint(0, 3), other_bytes=rng.randint(0, 5),
                         tied=rng.random() < 0.3, dtype_bytes=2, hidden_size=8,
                         kv_bytes_per_token=rng.randint(0, 2))
        reserve = Reserve(context_tokens=rng.randint(0, 3), activation_bytes=rng.randint(0, 9))
        nodes = [node(i, rng.randint(20, 400)) for i in range(1, stages + 1)]
        expected = brute_force(p, reserve, [n.memory_usable_bytes for n in nodes])
        try:
            plan = plan_stages(p, stages, nodes, reserve=reserve)
        except PlanRefused:
            assert expected is None
            refused += 1
            continue
        assert plan.fits and expected is not None
        assert sum(s.needed_bytes ** 2 * (SCALE // s.node.memory_usable_bytes)
                   for s in plan.stages) == expected
    assert 20 < refused < 380  # both kinds were tried


def test_tied_splits_go_to_the_smallest_boundaries() -> None:
    """The docstring's rule: among splits of equal cost, the smallest boundary, last stage
    first; with equal layers on equal nodes the later stages take the extra layers."""
    for layers, stages, expected in [(3, 2, [(0, 1), (1, 3)]),
                                     (5, 3, [(0, 1), (1, 3), (3, 5)]),
                                     (7, 4, [(0, 1), (1, 3), (3, 5), (5, 7)]),
                                     (6, 4, [(0, 1), (1, 2), (2, 4), (4, 6)])]:
        nodes = [node(i, 8 * GIB) for i in range(1, stages + 1)]
        plan = plan_stages(profile(layers=layers), stages, nodes, reserve=NO_RESERVE)
        assert [s.layers for s in plan.stages] == expected, (layers, stages)


def test_ties_against_every_split() -> None:
    """Layers of one or two bytes on nodes of two sizes: many splits cost the same,
    and the plan is the tied split with the smallest boundaries, last stage first."""
    rng = random.Random(15)
    tied = 0
    for _ in range(500):
        layers = rng.randint(2, 8)
        p = LayerProfile(layer_bytes=tuple(rng.randint(1, 2) for _ in range(layers)),
                         embed_bytes=0, head_bytes=0, norm_bytes=0, other_bytes=0,
                         tied=False, dtype_bytes=2, hidden_size=8, kv_bytes_per_token=0)
        memory = [rng.choice((100, 200)) for _ in range(rng.randint(2, min(layers, 4)))]
        splits: dict[int, list[list[int]]] = {}
        for cut in itertools.combinations(range(1, layers), len(memory) - 1):
            bounds = [0, *cut, layers]
            loads = [p.weight_bytes(s, e) for s, e in itertools.pairwise(bounds)]
            cost = sum(load * load * (SCALE // m) for load, m in zip(loads, memory, strict=True))
            splits.setdefault(cost, []).append(bounds)
        best = splits[min(splits)]
        tied += len(best) > 1
        expected = min(best, key=lambda bounds: bounds[::-1])
        plan = plan_stages(p, len(memory), [node(i, m) for i, m in enumerate(memory, 1)],
                           reserve=NO_RESERVE)
        assert [s.layers[0] for s in plan.stages] + [layers] == expected, (p, memory, best)
    assert tied > 50, tied  # ties were what was tried


def test_100_nodes_and_200_layers() -> None:
    """The bench's size (bench/bringup.py measures its time): every node used, every layer
    placed, each stage non-empty and in address order."""
    nodes = [node(i, (16 + 16 * (i % 5)) * GIB) for i in range(1, 101)]
    nodes = [PlanNode(n.node_id, f"10.0.{i // 200}.{i % 200 + 1}:19000", n.memory_usable_bytes,
                      19100) for i, n in enumerate(nodes)]
    p = profile(layers=200, embed=GIB, head=GIB)
    plan = plan_stages(p, 100, nodes)
    assert plan.fits and plan.stages[-1].layers[1] == 200
    assert [s.node.key for s in plan.stages] == sorted(n.key for n in nodes)
    assert all(s.layers[0] < s.layers[1] for s in plan.stages)


def test_table_and_json() -> None:
    plan = plan_stages(profile(layers=8, embed=100 * MIB), 2,
                       [node(1, 4 * GIB, name="mac-studio"), node(2, 2 * GIB)])
    table = render_plan_table(plan).splitlines()
    assert table[0].split() == ["STAGE", "NODE", "ADDRESS", "LAYERS", "BYTES", "RESERVE",
                                "USABLE", "HEADROOM"]
    assert table[1].split()[:4] == ["stage-0", "mac-studio", "10.0.0.1:19100", "[0,"]
    assert "KV cache for 8192 tokens at full precision + 512.0 MiB activations" in table[-1]
    body = plan_json(plan)
    assert body["schema"] == "mlxctl.plan/1"
    assert json.loads(json.dumps(body)) == body
    s0 = body["stages"][0]
    assert (s0["stage"], s0["node_id"], s0["node_address"], s0["address"]) == \
        ("stage-0", "mac-studio", "10.0.0.1:19000", "10.0.0.1:19100")
    assert s0["headroom_bytes"] == s0["usable_bytes"] - s0["weight_bytes"] - s0["reserve_bytes"]
    assert [s["layers"] for s in body["stages"]] == [[0, s0["layers"][1]],
                                                     [s0["layers"][1], 8]]


def test_the_table_shows_what_each_layer_weighs() -> None:
    """A dense first layer and MoE layers after it (DeepSeek-V3's shape) are priced as
    they are, and the table and the JSON say so: the split is balanced by bytes."""
    dense_then_moe = (10 * MIB, *(300 * MIB,) * 5, 200 * MIB)
    p = LayerProfile(layer_bytes=dense_then_moe, embed_bytes=0, head_bytes=0, norm_bytes=0,
                     other_bytes=0, tied=True, dtype_bytes=2, hidden_size=1024,
                     kv_bytes_per_token=0)
    plan = plan_stages(p, 2, [node(1, 4 * GIB), node(2, 4 * GIB)])
    assert ("layer weights: [0, 1) 10.0 MiB, [1, 6) 300.0 MiB each, [6, 7) 200.0 MiB"
            in render_plan_table(plan).splitlines())
    assert plan_json(plan)["layer_bytes"] == list(dense_then_moe)
    assert [s.layers for s in plan.stages] == [(0, 4), (4, 7)]  # 910 MiB and 800 MiB
    assert layer_runs(tuple(range(9)), most=3) == (
        "[0, 1) 0 B, [1, 2) 1 B, [2, 3) 2 B, and 6 more runs (--json has every layer)")


def test_sizes_and_usable_memory() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536 * MIB, -4 * GIB, 3 << 40)] == \
        ["0 B", "1023 B", "1 KiB", "1.5 GiB", "-4.0 GiB", "3.0 TiB"]
    assert usable_memory(10 * GIB) == 9 * GIB
    assert usable_memory(1000, 0.25) == 750 and usable_memory(0) == 0
    with pytest.raises(ValueError, match="not within"):
        usable_memory(GIB, 1.0)


def test_round_trip_through_the_cluster_toml(fixture_dir: Path, tmp_path: Path) -> None:
    model = fixture_dir / "llama"
    p = layer_profile(model)
    nodes = [PlanNode("b", "127.0.0.3:19000", 8 * GIB, 19301),
             PlanNode("a", "127.0.0.2:19000", 8 * GIB, 19201)]
    plan = plan_stages(p, 2, nodes, reserve=Reserve(context_tokens=512))
    file = tmp_path / "cluster.toml"
    secret = tmp_path / "secret"
    cfg = plan.to_cluster("lab", model.absolute(), "127.0.0.1:19000", secret, path=file)
    write_cluster(cfg, file)
    loaded = load_cluster(file)
    assert loaded == cfg and dump_cluster(loaded) == dump_cluster(cfg)
    validate_layers(loaded, p.num_layers)
    assert loaded.name == "lab" and loaded.secret_file == str(secret)
    assert [(n.id, n.address, n.rank, n.layers, n.memory_bytes) for n in loaded.stages] == [
        ("stage-0", "127.0.0.2:19201", 0, (0, 1), 8 * GIB),
        ("stage-1", "127.0.0.3:19301", 1, (1, 2), 8 * GIB)]
    assert loaded.coordinator.address == "127.0.0.1:19000"
    # What a daemon started with --distributed-config FILE --node-id stage-1 checks.
    placed = place(file, "stage-1")
    assert placed.node.layers == (1, 2) and placed.model == model.absolute()


def test_to_cluster_refuses_what_the_file_would_not_allow(tmp_path: Path) -> None:
    plan = plan_stages(profile(), 2, [node(1, GIB), node(2, GIB)], reserve=NO_RESERVE)
    with pytest.raises(ConfigError, match="same address"):
        plan.to_cluster("lab", None, "10.0.0.1:19100", path=tmp_path / "c.toml")
    with pytest.raises(ConfigError, match=r"cluster\.name"):
        plan.to_cluster("", None, "10.0.0.1:19000", path=tmp_path / "c.toml")


def test_the_push_is_made_from_the_plan_and_agrees_with_its_toml(fixture_dir: Path) -> None:
    """``make_plan`` gives a typed ``Proposal``: the push is built from its stages, and its
    JSON (``mlxctl cluster plan --json``) and TOML say the same things."""
    model = fixture_dir / "llama"

    def peer(address: str, node_id: str, port: int) -> PeerRow:
        return PeerRow(address=address, source="static", state="reachable", updated_at=1.0,
                       node_id=node_id, memory_total=64 * GIB, memory_available=32 * GIB,
                       inventory={"ports": [port, port + 1], "model": None})

    proposal = make_plan([peer("127.0.0.3:19000", "b", 19301),
                          peer("127.0.0.2:19000", "a", 19201)], model, 2, cluster="lab",
                         coordinator="127.0.0.1:19000")
    assert proposal.model_identity == model_identity(model) and proposal.notes == ()
    pushed = push_plan("lab", proposal)
    assert (pushed.cluster, pushed.model_identity, pushed.toml) == \
        ("lab", proposal.model_identity, proposal.toml)
    assert [(o.agent, o.stage, o.node_id, o.port) for o in pushed.stages] == [
        ("127.0.0.2:19000", 0, "stage-0", 19201), ("127.0.0.3:19000", 1, "stage-1", 19301)]
    toml = parse_cluster_text(proposal.toml, Path("c.toml"))
    assert [(n.id, n.address, n.layers) for n in toml.stages] == \
        [(o.node_id, f"127.0.0.{2 + o.stage}:{o.port}", o.layers) for o in pushed.stages]
    shown = json.loads(json.dumps(proposal.to_json()))
    assert shown["toml"] == proposal.toml and shown["table"] == proposal.table
    assert [(s["node_address"], s["address"], s["layers"]) for s in shown["plan"]["stages"]] \
        == [(o.agent, f"127.0.0.{2 + o.stage}:{o.port}", list(o.layers))
            for o in pushed.stages]
    # A drained node (`mlxctl drain`) is left out of the plan, and the notes say so.
    three = [peer("127.0.0.3:19000", "b", 19301), peer("127.0.0.2:19000", "a", 19201),
             peer("127.0.0.4:19000", "c", 19401)]
    around = make_plan(three, model, 2, cluster="lab", coordinator="127.0.0.1:19000",
                       drained=frozenset({"a"}))
    assert [s.node.node_id for s in around.plan.stages] == ["b", "c"]
    assert around.notes == ("a (127.0.0.2:19000) is drained: left out of every plan until "
                            "`mlxctl undrain a`",)
    with pytest.raises(PlanRefused, match=r"a \(127\.0\.0\.2:19000\) is drained"):
        make_plan(three, model, 3, cluster="lab", coordinator="127.0.0.1:19000",
                  drained=frozenset({"a"}))
