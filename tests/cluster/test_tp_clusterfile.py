"""``[cluster] tensor_parallel_size`` in a cluster TOML: each hybrid node's ``--tp-size``
(``placed_config`` places it as the flag does), and refused by name where tensor
parallelism is not built (prefill and decode nodes, a router, a pipeline's file), and
``--tp-size`` beside a pipeline's file: a stage node's group, refused on its coordinator."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from mlxceld.cluster.clusterfile.load import dump_cluster, load_cluster, parse_cluster_text
from mlxceld.cluster.clusterfile.placement import serving_config
from mlxceld.config.daemon import Config, Overrides, build_config
from mlxceld.errors import ConfigError
from mlxceld.models import model_config, preset

from helpers.clusterfile import POOLS_FILE, router_file, write_cluster_toml


def _setup(tmp_path: Path, text: str, family: str = "llama") -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)  # the tiny preset's config.json: heads 4, KV heads 2
    (model / "config.json").write_text(json.dumps(model_config(preset("tiny", family=family),
                                                               [1])))
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def _base(tmp_path: Path) -> dict[str, Any]:
    return {"daemon": {"state_dir": str(tmp_path / "state")}}


def _placed(tmp_path: Path, path: Path, node: str, **flags: Any) -> Config:
    given = Overrides(distributed_config=path, node_id=node, **flags)
    return serving_config(build_config(_base(tmp_path), None, given), given)


def test_a_hybrid_runs_as_with_the_flag_and_a_router_with_one(tmp_path: Path) -> None:
    path = _setup(tmp_path, router_file("tensor_parallel_size = 2"))
    assert load_cluster(path).tensor_parallel_size == 2
    placed = _placed(tmp_path, path, "h1")
    by_flags = build_config(_base(tmp_path), None, Overrides(
        model=str(tmp_path / "model"), tp_size=2, cluster_name="serve-1",
        agent_addr="studio-2.local:19000"))
    assert placed.serve == by_flags.serve
    assert placed.serve.tp_size == 2
    assert _placed(tmp_path, path, "router").serve.tp_size == 1  # it holds no model
    assert _placed(tmp_path, path, "h1", tp_size=2).serve.tp_size == 2  # says the same
    assert load_cluster(_setup(tmp_path, router_file())).tensor_parallel_size == 1


def test_it_is_written_back_as_read(tmp_path: Path) -> None:
    path = _setup(tmp_path, router_file("tensor_parallel_size = 4"))
    cfg = load_cluster(path)
    assert "tensor_parallel_size = 4" in dump_cluster(cfg)
    assert parse_cluster_text(dump_cluster(cfg), path) == cfg
    assert "tensor_parallel_size" not in dump_cluster(load_cluster(_setup(tmp_path,
                                                                          router_file())))


@pytest.mark.parametrize(("text", "message"), [
    (router_file("tensor_parallel_size = 0"),
     r"'cluster\.tensor_parallel_size' must be at least 1, not 0"),
    (router_file("tensor_parallel_size = 17"),
     r"'cluster\.tensor_parallel_size' is 17, more than the 16"),
    (router_file('tensor_parallel_size = "2"'),
     r"'cluster\.tensor_parallel_size' must be an integer"),
    (POOLS_FILE.replace("[cluster]", "[cluster]\ntensor_parallel_size = 2"),
     r"'cluster\.tensor_parallel_size' is 2, and node 'p1' is a prefill node: tensor "
     r"parallelism on prefill and decode nodes is not built yet"),
])
def test_a_bad_value_is_refused_naming_the_key(tmp_path: Path, text: str,
                                               message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_cluster(_setup(tmp_path, text))


def test_a_pipelines_file_is_refused_naming_both_keys(tmp_path: Path) -> None:
    _setup(tmp_path, "")
    path = write_cluster_toml(tmp_path, tmp_path / "model", [(0, 1), (1, 2)])
    path.write_text(path.read_text().replace("pipeline_parallel_size = 2",
                                             "pipeline_parallel_size = 2\n"
                                             "tensor_parallel_size = 2"))
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert re.search(r"'cluster\.tensor_parallel_size' is 2 in a pipeline's cluster TOML "
                     r"\('cluster\.pipeline_parallel_size' is 2\): its pipeline_stage nodes "
                     r"are one host each", err.value.message)
    assert "--tp-size" in err.value.hint and "pipeline_tensor_parallel" in err.value.hint


def test_the_flag_beside_a_pipelines_file_makes_a_stage_a_group_and_not_the_coordinator(
        tmp_path: Path) -> None:
    _setup(tmp_path, "")
    path = write_cluster_toml(tmp_path, tmp_path / "model", [(0, 1), (1, 2)])
    assert _placed(tmp_path, path, "s0", tp_size=2).serve.tp_size == 2  # a stage node
    with pytest.raises(ConfigError, match=r"^--tp-size 2 with distributed_config "
                       r"\(--distributed-config\) .*: node 'coord' is the pipeline's "
                       r"coordinator, whose router holds no layers to split") as err:
        _placed(tmp_path, path, "coord", tp_size=2)
    assert "set tp_size on the stage hosts" in err.value.hint
    with pytest.raises(ConfigError, match=r"^--tp-size 2 with --tp-peers and "
                       r"distributed_config \(--distributed-config\): a pipeline stage whose "
                       r"tensor-parallel group spans hosts is built for a --pp-peer stage "
                       r"host only"):
        _placed(tmp_path, path, "s1", tp_size=2, tp_peers="10.0.0.9")


@pytest.mark.parametrize(("text", "node", "message"), [
    (router_file("tensor_parallel_size = 2"), "router",
     r"^--tp-size 2 contradicts --distributed-config: .*node 'router' is a router, which "
     r"holds no model"),
    (router_file(), "h1", r"^--tp-size 2 contradicts --distributed-config: .*node 'h1' is a "
     r"hybrid node, and the file's 'cluster\.tensor_parallel_size' is 1"),
    (POOLS_FILE, "d1", r"^--tp-size 2 contradicts --distributed-config: .*node 'd1' is a "
     r"decode node, where tensor parallelism is not built yet"),
])
def test_a_flag_that_contradicts_the_file_is_refused(tmp_path: Path, text: str, node: str,
                                                     message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _placed(tmp_path, _setup(tmp_path, text), node, tp_size=2)
    assert "tensor_parallel_size" in err.value.hint


def test_a_model_the_size_does_not_split_is_refused_naming_the_keys(tmp_path: Path) -> None:
    path = _setup(tmp_path, router_file("tensor_parallel_size = 4"))
    with pytest.raises(ConfigError) as err:
        _placed(tmp_path, path, "h1")
    assert err.value.message.startswith(
        f"{path}: 'cluster.model' with 'cluster.tensor_parallel_size' 4: "
        f"{tmp_path / 'model' / 'config.json'}: tp_size 4 does not divide num_key_value_heads")
    _placed(tmp_path, path, "router")  # no model to split there: placed
    gemma = _setup(tmp_path, router_file("tensor_parallel_size = 2"), family="gemma3")
    with pytest.raises(ConfigError, match="model_type 'gemma3'"):
        _placed(tmp_path, gemma, "h2")
