"""Replica groups in the cluster TOML: ``[cluster] replicas = R``, each stage's ``replica``;
every group a whole pipeline, its stages' neighbours within it; each bad file refused
naming the node and the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mlxceld.cluster.clusterfile.load import (
    dump_cluster,
    load_cluster,
    parse_cluster_text,
    validate_layers,
    write_cluster,
)
from mlxceld.cluster.clusterfile.model import StageEntry, pipeline_cluster
from mlxceld.cluster.clusterfile.placement import (
    Placement,
    pipeline_options,
    replica_pipelines,
    stage_options,
)
from mlxceld.config.daemon import Config
from mlxceld.config.serve import ServeConfig
from mlxceld.daemon.roster import Situation, draw_roster, router_needs
from mlxceld.errors import ConfigError
from mlxceld.roles.options import RouterOptions

Node = dict[str, object]


def stage(node_id: str, host: int, replica: int | None, rank: int,
          layers: tuple[int, int]) -> Node:
    n: Node = {"id": node_id, "address": f"127.0.0.{host}:19100", "role": "pipeline_stage",
               "rank": rank, "layers": list(layers)}
    if replica is not None:
        n["replica"] = replica
    return n


def two_by_two() -> list[Node]:
    """Two replicas of two stages over 8 layers, written out of order."""
    return [stage("b1", 5, 1, 1, (4, 8)), stage("a0", 2, 0, 0, (0, 4)),
            stage("b0", 4, 1, 0, (0, 4)), stage("a1", 3, 0, 1, (4, 8))]


def text(nodes: list[Node], *, size: int = 2, replicas: int | None = 2,
         coordinator: Node | None = None) -> str:
    lines = ["[cluster]", f"pipeline_parallel_size = {size}"]
    if replicas is not None:
        lines.append(f"replicas = {replicas}")
    coord: Node = coordinator or {"id": "coord", "address": "127.0.0.1:19000",
                                  "role": "coordinator"}
    for n in [coord, *nodes]:
        lines.append("[[nodes]]")
        for k, v in n.items():
            lines.append(f"{k} = " + (f'"{v}"' if isinstance(v, str) else
                                      str(v).replace("(", "[").replace(")", "]")))
    return "\n".join(lines) + "\n"


def read(tmp_path: Path, body: str) -> object:
    path = tmp_path / "cluster.toml"
    path.write_text(body)
    return load_cluster(path)


def refused(tmp_path: Path, body: str, *words: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        read(tmp_path, body)
    for word in words:
        assert word in err.value.message, (word, err.value.message)
    assert err.value.hint
    return err.value


def test_groups_and_their_neighbours(tmp_path: Path) -> None:
    cfg = load_cluster(_written(tmp_path, text(two_by_two())))
    assert cfg.replicas == 2 and cfg.pipeline_parallel_size == 2
    assert [n.id for n in cfg.stages] == ["a0", "a1", "b0", "b1"]
    assert [[n.id for n in g] for g in cfg.groups] == [["a0", "a1"], ["b0", "b1"]]
    assert [n.id for n in cfg.group_of("b1")] == ["b0", "b1"]
    assert getattr(cfg.upstream_of("b0"), "id", None) == "coord"
    assert getattr(cfg.downstream_of("b0"), "id", None) == "b1"
    assert cfg.downstream_of("a1") is None and cfg.downstream_of("b1") is None
    validate_layers(cfg, 8)
    # A stage's worker knows only its own group; the router gets every group.
    b1 = Placement(cfg, cfg.stages[3], Path("/m"), "sha256:x")
    o = stage_options(b1)
    assert (o.rank, o.upstream, o.downstream) == (1, "127.0.0.4:19100", None)
    assert (o.first, o.last) == ("127.0.0.4:19100", None)
    a0 = stage_options(Placement(cfg, cfg.stages[0], Path("/m"), "sha256:x"))
    assert (a0.downstream, a0.last) == ("127.0.0.3:19100", "127.0.0.3:19100")
    router = Placement(cfg, cfg.coordinator, Path("/m"), "sha256:x")
    assert [s.node_id for s in pipeline_options(router).stages] == ["a0", "a1"]
    assert [[s.node_id for s in p.stages] for p in replica_pipelines(router)] == [["b0", "b1"]]


def _written(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(body)
    return path


def test_round_trip_and_one_replica_unchanged(tmp_path: Path) -> None:
    cfg = load_cluster(_written(tmp_path, text(two_by_two())))
    dumped = dump_cluster(cfg)
    assert "replicas = 2" in dumped and dumped.count("replica = ") == 4
    again = tmp_path / "again.toml"
    write_cluster(cfg, again)
    assert load_cluster(again) == dataclasses.replace(cfg, path=again)
    # One replica: `replica` may be left out or be 0, and is not written back.
    one = [stage("a0", 2, None, 0, (0, 4)), stage("a1", 3, 0, 1, (4, 8))]
    single = load_cluster(_written(tmp_path, text(one, replicas=None)))
    assert single.replicas == 1 and len(single.groups) == 1
    assert "replica" not in dump_cluster(single)


def test_pipeline_cluster_writes_groups(tmp_path: Path) -> None:
    entries = [StageEntry(f"stage-{i}", f"127.0.0.{2 + i}:19100", (0, 4) if i % 2 == 0
                          else (4, 8), replica=i // 2) for i in range(4)]
    path = tmp_path / "c.toml"
    cfg = parse_cluster_text(dump_cluster(pipeline_cluster(
        "c", "m", ("coordinator", "127.0.0.1:19000"), entries, path=path)), path)
    assert (cfg.replicas, cfg.pipeline_parallel_size) == (2, 2)
    assert [(n.id, n.replica, n.rank) for n in cfg.stages] == [
        ("stage-0", 0, 0), ("stage-1", 0, 1), ("stage-2", 1, 0), ("stage-3", 1, 1)]


def test_bad_files_are_refused_by_node_and_field(tmp_path: Path) -> None:
    refused(tmp_path, text(two_by_two(), replicas=0), "'cluster.replicas'", "at least 1")
    refused(tmp_path, text(two_by_two(), replicas=9), "'cluster.replicas'", "9", "8")
    missing = two_by_two()
    del missing[0]["replica"]
    refused(tmp_path, text(missing), "node 'b1'", "'replica' is missing")
    outside = two_by_two()
    outside[0]["replica"] = 2
    refused(tmp_path, text(outside), "node 'b1'", "'replica' is 2", "groups 0..1")
    refused(tmp_path, text(two_by_two(), coordinator={
        "id": "coord", "address": "127.0.0.1:19000", "role": "coordinator", "replica": 0}),
        "node 'coord'", "'replica'")
    short = two_by_two()[1:]  # no b1
    refused(tmp_path, text(short), "replica 1 has 1 stage(s) ('b0')",
            "pipeline_parallel_size")
    twice = [*two_by_two()[1:], stage("b1", 5, 1, 0, (4, 8))]
    refused(tmp_path, text(twice), "node 'b0' and node 'b1' both have rank 0")
    gap = [*two_by_two()[1:], stage("b1", 5, 1, 1, (5, 8))]
    refused(tmp_path, text(gap), "layer 4 is on no stage", "'b1' (replica 1, rank 1")
    same_address = [*two_by_two()[:3], stage("a1", 2, 0, 1, (4, 8))]
    refused(tmp_path, text(same_address), "same address")
    same_id = [*two_by_two()[1:], stage("a0", 5, 1, 1, (4, 8))]
    refused(tmp_path, text(same_id), "both have id 'a0'")


def test_each_group_must_cover_the_model(tmp_path: Path) -> None:
    nodes = [*two_by_two()[1:], stage("b1", 5, 1, 1, (4, 7))]
    cfg = load_cluster(_written(tmp_path, text(nodes)))
    with pytest.raises(ConfigError) as err:
        validate_layers(cfg, 8)
    assert "layer 7 is on no stage" in err.value.message
    assert "node 'b1' (replica 1, rank 1" in err.value.message
    with pytest.raises(ConfigError) as err:
        validate_layers(cfg, 7)
    assert "node 'a1' (rank 1, layers [4, 8]) reaches layer 7" in err.value.message


def test_the_coordinator_runs_one_router_over_every_group(tmp_path: Path) -> None:
    """... and no group's stage is needed by every request: a drained stage host is not
    held from the router (its group's requests go to the others)."""
    cfg = load_cluster(_written(tmp_path, text(two_by_two())))
    state = Path("/nonexistent/mlxceld")
    config = Config(state_dir=state, socket=state / "s.sock")
    placement = Placement(cfg, cfg.coordinator, Path("/models/tiny"), "ab" * 32)
    specs = draw_roster(Situation(config, ServeConfig(model="/models/tiny"), placement,
                                  secret=b"s" * 32))
    (router,) = specs
    assert isinstance(router.options, RouterOptions) and router.options.pipeline is not None
    assert [s.node_id for s in router.options.pipeline.stages] == ["a0", "a1"]
    assert [[s.node_id for s in p.stages] for p in router.options.replica_pipelines] == [
        ["b0", "b1"]]
    assert router_needs(specs, {"coord"}) == {"coord"}
