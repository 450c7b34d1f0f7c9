"""A pipeline of tensor-parallel stages across hosts in a cluster TOML, the 2D mesh (issue
32): ``pipeline_parallel_size`` P and ``tensor_parallel_size`` T over a coordinator and,
per stage, T nodes of role ``pipeline_tensor_parallel`` (aliases ``pp_tp``, ``2d``) with
the stage's layers and ranks 0 .. T-1. A stage's rank 0 is placed as a pipeline stage
whose group spans hosts (``Placement.tp_peers``: its ranks' agents in rank order), its
other ranks as ``--node-role tensor_parallel_rank``; every wrong file or contradicting
flag is refused naming the file, the node and the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from mlxceld.cluster.clusterfile.load import (
    dump_cluster,
    load_cluster,
    needs_secret,
    parse_cluster_text,
    write_cluster,
)
from mlxceld.cluster.clusterfile.placement import (
    place,
    served_node,
    serving_config,
    stage_options,
)
from mlxceld.config.daemon import Config, Overrides, build_config
from mlxceld.config.serve import ServeConfig
from mlxceld.daemon.roster import stage_group
from mlxceld.errors import ConfigError
from mlxceld.models import model_config, preset

from helpers.clusterfile import mesh_file, tensor_file, write_cluster_toml


def _setup(tmp_path: Path, text: str, kv_heads: int = 2) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)  # the tiny preset: 2 layers, heads 4
    (model / "config.json").write_text(json.dumps(model_config(preset("tiny", kv_heads=kv_heads),
                                                               [1])))
    (model / "model.safetensors").write_bytes(b"")  # its identity: names and sizes
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def _placed(tmp_path: Path, path: Path, node: str, base: dict[str, Any] | None = None,
            **flags: Any) -> Config:
    given = Overrides(distributed_config=path, node_id=node, **flags)
    return serving_config(build_config(base or {"daemon": {"state_dir": str(tmp_path / "s")}},
                                       None, given), given)


def test_the_mesh_reads_its_stages_in_layers_order_and_round_trips(tmp_path: Path) -> None:
    path = _setup(tmp_path, mesh_file())
    cfg = load_cluster(path)
    assert cfg.mesh and not cfg.tensor and not cfg.serving and needs_secret(cfg)
    assert (cfg.pipeline_parallel_size, cfg.tensor_parallel_size) == (2, 2)
    assert [(n.id, n.layers) for n in cfg.stages] == [("stage-0", (0, 1)), ("stage-1", (1, 2))]
    # every alias is read as the role; a rank host's address is an agent's (port 19000)
    assert {n.role for n in cfg.nodes if n.id != "coordinator"} == {"pipeline_tensor_parallel"}
    assert [(n.id, n.address) for n in cfg.stage_ranks("stage-1-tp-1")] == [
        ("stage-1", "10.0.0.3:19100"), ("stage-1-tp-1", "10.0.0.5:19000")]
    assert cfg.downstream_of("stage-0") == cfg.node("stage-1")
    out = tmp_path / "out.toml"
    write_cluster(dataclasses.replace(cfg, path=out), out)
    assert load_cluster(out) == dataclasses.replace(cfg, path=out)
    assert "tensor_parallel_size = 2" in dump_cluster(cfg)


def test_a_stage_is_placed_with_its_group_across_hosts(tmp_path: Path) -> None:
    path = _setup(tmp_path, mesh_file())
    p = place(path, "stage-1")
    assert p.tp_peers == ("10.0.0.5:19000",)
    assert stage_group(p, ServeConfig()) == (2, ("10.0.0.5:19000",))
    o = stage_options(p)  # its pipeline rank is its place in layers order, not its tp rank
    assert (o.rank, o.layers, o.upstream, o.first) == (1, (1, 2), "10.0.0.2:19100",
                                                       "10.0.0.2:19100")
    assert place(path, "coordinator").tp_peers == ()
    # the daemon's own config is the pipeline stage's: no flags made up for it
    assert _placed(tmp_path, path, "stage-0").serve == _placed(tmp_path, path,
                                                               "coordinator").serve
    # flags that say what the file says are taken
    _placed(tmp_path, path, "stage-0", tp_size=2, tp_peers="10.0.0.4")


def test_the_draft_goes_to_the_last_stage_s_rank_0(tmp_path: Path) -> None:
    """``[cluster] draft_model`` in a mesh's file: read, written back, and placed on the
    last stage's rank 0 alone (it drafts whole there: ``pipeline/tensor_stage.py``)."""
    path = _setup(tmp_path, mesh_file(extra='draft_model = "draft"\nnum_draft_tokens = 3'))
    cfg = load_cluster(path)
    assert (cfg.draft_model, cfg.num_draft_tokens) == ("draft", 3)
    assert "draft_model = \"draft\"" in dump_cluster(cfg)
    last = stage_options(place(path, "stage-1"))
    assert (last.draft_model, last.num_draft_tokens) == (str(tmp_path / "draft"), 3)
    assert stage_options(place(path, "stage-0")).draft_model is None


def test_a_rank_past_0_runs_as_a_rank_host(tmp_path: Path) -> None:
    path = _setup(tmp_path, mesh_file())
    rank = _placed(tmp_path, path, "stage-1-tp-1")
    assert (rank.serve.node_role, rank.serve.tp_size, rank.serve.tp_peers) == (
        "tensor_parallel_rank", 1, ())
    assert (rank.agent_addr, rank.cluster_name) == ("10.0.0.5:19000", "mesh")
    assert rank.serve.model == str(tmp_path / "model")
    assert served_node(load_cluster(path), "stage-1-tp-1") == (
        f"{path}: node 'stage-1-tp-1' (pipeline_tensor_parallel, rank 1)")


def test_a_model_the_stages_do_not_split_is_refused_on_every_node(tmp_path: Path) -> None:
    path = _setup(tmp_path, mesh_file(), kv_heads=1)  # one KV head: no split over 2
    said = f"{path}: 'cluster.model' with 'cluster.tensor_parallel_size' 2: "
    for node in ("coordinator", "stage-0"):
        with pytest.raises(ConfigError) as info:
            place(path, node)
        assert info.value.message.startswith(said), info.value.message
    with pytest.raises(ConfigError) as info:
        _placed(tmp_path, path, "stage-0-tp-1")
    assert info.value.message.startswith(said), info.value.message


def test_layers_that_do_not_cover_the_model_are_refused(tmp_path: Path) -> None:
    path = _setup(tmp_path, mesh_file().replace("[1, 2]", "[1, 3]"))
    with pytest.raises(ConfigError, match=r"node 'stage-1' \(layers \[1, 3\], rank 0\) "
                       r"reaches layer 2, but the model has only 2 layers"):
        place(path, "stage-0")


def _stage0_rank1(text: str, old: str, new: str) -> str:
    """``text`` with ``old`` replaced by ``new`` in stage-0-tp-1's table only."""
    head, _, tail = text.partition('id = "stage-0-tp-1"')
    return head + 'id = "stage-0-tp-1"' + tail.replace(old, new, 1)


BAD = {
    "no tensor_parallel_size": (
        mesh_file().replace("tensor_parallel_size = 2\n", ""),
        r"'cluster.tensor_parallel_size' is missing: the file has pipeline_tensor_parallel "
        r"nodes"),
    "a tensor_parallel_size of 1": (
        mesh_file().replace("tensor_parallel_size = 2", "tensor_parallel_size = 1"),
        r"'cluster.tensor_parallel_size' is 1 in a file of pipeline_tensor_parallel nodes"),
    "a tensor_parallel_size above 16": (
        mesh_file().replace("tensor_parallel_size = 2", "tensor_parallel_size = 17"),
        r"'cluster.tensor_parallel_size' is 17, more than the 16"),
    "no pipeline_parallel_size": (
        mesh_file().replace("pipeline_parallel_size = 2\n", ""),
        r"'cluster.pipeline_parallel_size' is missing"),
    "a pipeline_parallel_size that is not the stages": (
        mesh_file().replace("pipeline_parallel_size = 2", "pipeline_parallel_size = 3"),
        r"'cluster.pipeline_parallel_size' is 3, but the file has 2 stage\(s\) \(their rank "
        r"0: 'stage-0', 'stage-1'\)"),
    "replicas": (mesh_file(extra="replicas = 2"),
                 r"'cluster.replicas' is not for a 2D mesh's file \(it has "
                 r"pipeline_tensor_parallel nodes\): replica groups of a 2D mesh are not built"),
    "replicas = 1 too": (mesh_file(extra="replicas = 1"),
                         r"'cluster.replicas' is not for a 2D mesh's file"),
    "kv_compression": (mesh_file(extra='kv_compression = "int8"'),
                       r"'cluster.kv_compression' is not for a 2D mesh's file"),
    "a num_draft_tokens above 32": (
        mesh_file(extra='draft_model = "d"\nnum_draft_tokens = 33'),
        r"'cluster.num_draft_tokens' is 33, more than 32"),
    "a num_draft_tokens without a draft": (
        mesh_file(extra="num_draft_tokens = 3"),
        r"'cluster.num_draft_tokens' means nothing without 'cluster.draft_model'"),
    "an unknown cluster key": (mesh_file(extra="stages = 2"), r"unknown key 'cluster.stages'"),
    "a rank missing in a stage": (
        _stage0_rank1(mesh_file(), "rank = 1", "rank = 0").replace(
            'address = "10.0.0.4:19000"', 'address = "10.0.0.4:19100"'),
        r"node 'stage-0' and node 'stage-0-tp-1' both have rank 0 in the stage of layers "
        r"\[0, 1\]"),
    "a stage without its rank 0": (
        mesh_file().replace('[[nodes]]\nid = "stage-1"\naddress = "10.0.0.3:19100"\n'
                            'role = "pp_tp"\nlayers = [1, 2]\nrank = 0\n', ""),
        r"the stage of layers \[1, 2\] \('stage-1-tp-1'\) has no rank 0: "
        r"'cluster.tensor_parallel_size' is 2, so each stage has ranks 0 .. 1"),
    "a stage short of a rank": (
        mesh_file().replace("tensor_parallel_size = 2", "tensor_parallel_size = 4"),
        r"the stage of layers \[0, 1\] \('stage-0', 'stage-0-tp-1'\) has no rank 2"),
    "a rank out of range": (
        _stage0_rank1(mesh_file(), "rank = 1", "rank = 2"),
        r"node 'stage-0-tp-1': 'rank' is 2, but 'cluster.tensor_parallel_size' is 2 "
        r"\(ranks 0 .. 1\)"),
    "no rank": (_stage0_rank1(mesh_file(), "rank = 1\n", ""),
                r"node 'stage-0-tp-1': 'rank' is missing \(every pipeline_tensor_parallel "
                r"node has one\)"),
    "no layers": (_stage0_rank1(mesh_file(), "layers = [0, 1]\n", ""),
                  r"node 'stage-0-tp-1': 'layers' is missing"),
    "a rank whose layers name no stage": (
        _stage0_rank1(mesh_file(), "layers = [0, 1]", "layers = [0, 2]"),
        r"the stage of layers \[0, 1\] \('stage-0'\) has no rank 1"),
    "overlapping stages": (
        mesh_file().replace("[1, 2]", "[0, 2]"),
        r"layer 0 is on both node 'stage-0' \(layers \[0, 1\], rank 0\) and node 'stage-1' "
        r"\(layers \[0, 2\], rank 0\)"),
    "a gap between stages": (
        mesh_file().replace("[1, 2]", "[2, 3]"),
        r"layer 1 is on no stage: node 'stage-0' \(layers \[0, 1\], rank 0\) ends at 1"),
    "a replica on a rank": (mesh_file(stage0_extra="replica = 0"),
                            r"node 'stage-0': a pipeline_tensor_parallel node has no 'replica'"),
    "rank 0's address without a port": (
        mesh_file().replace('"10.0.0.2:19100"', '"10.0.0.2"'),
        r"node 'stage-0': 'address' '10\.0\.0\.2' has no ':port'"),
    "rank 0's address a wildcard": (
        mesh_file().replace('"10.0.0.2:19100"', '"0.0.0.0:19100"'),
        r"node 'stage-0': 'address' '0\.0\.0\.0:19100' is a wildcard"),
    "a rank's address a wildcard": (
        mesh_file().replace('"10.0.0.4:19000"', '"0.0.0.0:19000"'),
        r"node 'stage-0-tp-1': 'address' '0\.0\.0\.0:19000' is a wildcard"),
    "the same address twice": (
        mesh_file().replace('"10.0.0.4:19000"', '"10.0.0.5"'),
        r"node 'stage-1-tp-1' and node 'stage-0-tp-1' have the same address"),
    "an unknown node key": (mesh_file(stage0_extra="stage = 0"),
                            r"node 'stage-0': unknown key 'stage'"),
    "a bad resource": (mesh_file(stage0_extra="[nodes.resources]\ncompute_units = -1"),
                       r"node 'stage-0': 'resources.compute_units'"),
    "beside a pipeline stage": (
        mesh_file() + '\n[[nodes]]\nid = "s9"\naddress = "10.0.0.9:19100"\n'
        'role = "pipeline_stage"\nrank = 0\nlayers = [0, 1]\n',
        r"node 's9': role 'pipeline_stage' beside pipeline_tensor_parallel nodes"),
    "beside a tensor-parallel rank": (
        mesh_file() + '\n[[nodes]]\nid = "t9"\naddress = "10.0.0.9"\nrole = "tp"\nrank = 0\n',
        r"node 't9': role 'tensor_parallel_rank' beside pipeline_tensor_parallel nodes"),
    "beside a router": (
        mesh_file() + '\n[[nodes]]\nid = "r9"\naddress = "10.0.0.9"\nrole = "router"\n',
        r"node 'r9': role 'router' beside pipeline_tensor_parallel nodes"),
    "beside a hybrid": (
        mesh_file() + '\n[[nodes]]\nid = "h9"\naddress = "10.0.0.9"\nrole = "hybrid"\n',
        r"node 'h9': role 'hybrid' beside pipeline_tensor_parallel nodes"),
    "an unknown role beside": (
        mesh_file() + '\n[[nodes]]\nid = "x9"\naddress = "10.0.0.9"\nrole = "worker"\n',
        r"node 'x9': 'role' 'worker' is not one of .*pipeline_tensor_parallel"),
    "no coordinator": (
        mesh_file().replace('role = "coordinator"', 'role = "pp_tp"\nrank = 0\n'
                            'layers = [0, 9]'),
        r"no node has role 'coordinator'"),
    "two coordinators": (
        mesh_file() + '\n[[nodes]]\nid = "c2"\naddress = "10.0.0.9:19000"\n'
        'role = "coordinator"\n',
        r"2 nodes have role 'coordinator' \('coordinator', 'c2'\)"),
    "a coordinator with layers": (
        mesh_file().replace('role = "coordinator"', 'role = "coordinator"\nlayers = [0, 1]'),
        r"node 'coordinator': a coordinator has no 'layers'"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_mesh_is_refused_naming_the_file_node_and_key(case: str, tmp_path: Path) -> None:
    text, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as info:
        parse_cluster_text(text, tmp_path / "cluster.toml")
    assert info.value.message.startswith(str(tmp_path / "cluster.toml")), info.value.message
    assert info.value.hint


@pytest.mark.parametrize("role", ["pipeline_tensor_parallel", "pp_tp", "2d"])
def test_a_2d_role_in_a_pipelines_file_makes_it_a_mesh_and_is_judged_so(
        role: str, tmp_path: Path) -> None:
    path = write_cluster_toml(tmp_path, None, [(0, 1), (1, 2)])
    text = path.read_text().replace('role = "pipeline_stage"', f'role = "{role}"', 1)
    with pytest.raises(ConfigError, match=r"'cluster.tensor_parallel_size' is missing: the "
                       r"file has pipeline_tensor_parallel nodes"):
        parse_cluster_text(text, path)
    text = text.replace("pipeline_parallel_size", "tensor_parallel_size = 2\n"
                        "pipeline_parallel_size")
    with pytest.raises(ConfigError, match=r"node 's1': role 'pipeline_stage' beside "
                       r"pipeline_tensor_parallel nodes"):
        parse_cluster_text(text, path)


def test_a_2d_role_beside_a_tensor_groups_ranks_is_refused(tmp_path: Path) -> None:
    text = tensor_file().replace('role = "tp"\nrank = 1', 'role = "pp_tp"\nrank = 1\n'
                                 'layers = [0, 2]')
    with pytest.raises(ConfigError, match=r"node 'node-0': role 'tensor_parallel_rank' beside "
                       r"pipeline_tensor_parallel nodes"):
        parse_cluster_text(text, tmp_path / "cluster.toml")


CONTRADICTIONS = {
    "--tp-size on a stage": (
        "stage-0", {"tp_size": 4}, {},
        r"^--tp-size 4 contradicts --distributed-config: .*node 'stage-0' is rank 0 of its "
        r"stage's tensor-parallel group \(layers \[0, 1\]\), whose "
        r"'cluster\.tensor_parallel_size' is 2"),
    "--tp-peers on a stage": (
        "stage-0", {"tp_size": 2, "tp_peers": "10.0.0.5"}, {},
        r"^--tp-peers \(10\.0\.0\.5:19000\) contradicts --distributed-config: .*node "
        r"'stage-0' says tp_peers = 10\.0\.0\.4:19000"),
    "[serve] tp_peers on a stage": (
        "stage-1", {}, {"tp_size": 2, "tp_peers": ["10.0.0.4"]},
        r"^\[serve\] tp_peers \(10\.0\.0\.4:19000\) contradicts --distributed-config: "
        r".*node 'stage-1' says tp_peers = 10\.0\.0\.5:19000"),
    "--tp-size on a rank host": (
        "stage-0-tp-1", {"tp_size": 2}, {},
        r"^--tp-size 2 contradicts --distributed-config: .*node 'stage-0-tp-1' is rank 1 of "
        r"a stage's tensor-parallel group, which takes its size from the stage's rank 0"),
    "--tp-size on the coordinator": (
        "coordinator", {"tp_size": 2}, {},
        r"^--tp-size 2 with distributed_config \(--distributed-config\) .*node 'coordinator' "
        r"is the pipeline's coordinator"),
}


@pytest.mark.parametrize("case", CONTRADICTIONS)
def test_a_flag_that_contradicts_the_mesh_is_refused_naming_both(case: str,
                                                                tmp_path: Path) -> None:
    node, flags, serve, message = CONTRADICTIONS[case]
    base = {"daemon": {"state_dir": str(tmp_path / "s")}, "serve": serve}
    with pytest.raises(ConfigError, match=message):
        _placed(tmp_path, _setup(tmp_path, mesh_file()), node, base=base, **flags)
