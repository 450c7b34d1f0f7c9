"""A tensor-parallel group across hosts in a cluster TOML (issue 32): ``[cluster]
tensor_parallel_size = N`` over N nodes of role ``tensor_parallel_rank`` (alias ``tp``),
ranks 0 .. N-1. Each node is placed as the flags place it (rank 0: ``--tp-size N
--tp-peers`` the others' agent addresses; the others: ``--node-role
tensor_parallel_rank``), and every wrong file or contradicting flag is refused naming the
file, node and key."""

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
from mlxceld.cluster.clusterfile.placement import served_node, serving_config
from mlxceld.cluster.keyring import require_secret
from mlxceld.config.daemon import Config, Overrides, build_config
from mlxceld.config.tensor import across_hosts
from mlxceld.errors import ConfigError
from mlxceld.models import model_config, preset

from helpers.clusterfile import router_file, tensor_file


def _setup(tmp_path: Path, text: str) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)  # the tiny preset's config.json: heads 4, KV heads 2
    (model / "config.json").write_text(json.dumps(model_config(preset("tiny"), [1])))
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def _base(tmp_path: Path) -> dict[str, Any]:
    return {"daemon": {"state_dir": str(tmp_path / "state")}}


def _placed(tmp_path: Path, path: Path, node: str, base: dict[str, Any] | None = None,
            **flags: Any) -> Config:
    given = Overrides(distributed_config=path, node_id=node, **flags)
    return serving_config(build_config(base or _base(tmp_path), None, given), given)


def _flags(tmp_path: Path, **flags: Any) -> Config:
    return build_config(_base(tmp_path), None, Overrides(model=str(tmp_path / "model"),
                                                         cluster_name="tp-1", **flags))


def test_the_reference_files_group_reads_and_round_trips(tmp_path: Path) -> None:
    path = _setup(tmp_path, tensor_file())
    cfg = load_cluster(path)
    assert cfg.tensor and not cfg.serving and needs_secret(cfg)
    assert cfg.tensor_parallel_size == 2
    assert [(n.id, n.role, n.rank, n.address) for n in cfg.tensor_ranks] == [
        ("node-0", "tensor_parallel_rank", 0, "10.0.0.10:19000"),
        ("node-1", "tensor_parallel_rank", 1, "studio-2.local:19000")]  # "tp": the alias
    text = dump_cluster(cfg)
    assert "tensor_parallel_size = 2" in text and "pipeline_parallel_size" not in text
    out = tmp_path / "out.toml"
    write_cluster(dataclasses.replace(cfg, path=out), out)
    assert load_cluster(out) == dataclasses.replace(cfg, path=out)
    assert served_node(cfg, "node-1") == f"{path}: node 'node-1' (tensor_parallel_rank, rank 1)"


def test_rank_0_runs_as_tp_size_and_tp_peers_and_the_others_as_rank_hosts(
        tmp_path: Path) -> None:
    path = _setup(tmp_path, tensor_file().replace('address = "10.0.0.10:19000"',
                                                  'address = "10.0.0.10"'))
    rank0 = _placed(tmp_path, path, "node-0")
    assert rank0.serve == _flags(tmp_path, tp_size=2, tp_peers="studio-2.local").serve
    assert (rank0.serve.node_role, rank0.serve.tp_size, rank0.serve.tp_peers) == (
        "hybrid", 2, ("studio-2.local:19000",))
    assert (rank0.cluster_name, rank0.agent_addr) == ("tp-1", "10.0.0.10:19000")
    rank1 = _placed(tmp_path, path, "node-1")
    assert rank1.serve == _flags(tmp_path, node_role="tensor_parallel_rank").serve
    assert (rank1.serve.tp_size, rank1.serve.tp_peers) == (1, ())
    assert rank1.agent_addr == "studio-2.local:19000"
    assert across_hosts(rank1.serve.node_role, rank1.serve.tp_peers) is not None
    # Flags that say what the file says are taken; --agent-addr says where to bind.
    same = _placed(tmp_path, path, "node-0", tp_size=2, tp_peers="studio-2.local:19000",
                   agent_addr="0.0.0.0:19000")
    assert same.serve == rank0.serve


def test_the_peers_are_in_rank_order_not_file_order(tmp_path: Path) -> None:
    nodes = "".join(f'\n[[nodes]]\nid = "n{r}"\naddress = "10.0.0.{10 + r}"\n'
                    f'role = "tp"\nrank = {r}\n' for r in (2, 0, 3, 1))
    path = _setup(tmp_path, f'[cluster]\nmodel = "model"\ntensor_parallel_size = 4\n{nodes}')
    model = tmp_path / "model" / "config.json"
    model.write_text(json.dumps(model_config(preset("tiny", kv_heads=4), [1])))
    rank0 = _placed(tmp_path, path, "n0")
    assert rank0.serve.tp_peers == ("10.0.0.11:19000", "10.0.0.12:19000", "10.0.0.13:19000")
    assert rank0.serve.tp_size == 4


BAD = {
    "a rank missing": (tensor_file().replace("rank = 1\n", ""),
                       r"node 'node-1': 'rank' is missing \(every tensor_parallel_rank node "
                       r"has one\)"),
    "a rank twice": (tensor_file().replace("rank = 1", "rank = 0"),
                     r"node 'node-0' and node 'node-1' both have rank 0"),
    "a rank out of range": (tensor_file().replace("rank = 1", "rank = 2"),
                            r"node 'node-1': 'rank' is 2, but 'cluster.tensor_parallel_size' "
                            r"is 2 \(ranks 0 .. 1\)"),
    "a negative rank": (tensor_file().replace("rank = 1", "rank = -1"),
                        r"node 'node-1': 'rank' must be at least 0, not -1"),
    "a boolean rank": (tensor_file().replace("rank = 1", "rank = true"),
                       r"node 'node-1': 'rank' must be an integer"),
    "no size": (tensor_file().replace("tensor_parallel_size = 2\n", ""),
                r"'cluster.tensor_parallel_size' is missing: the file has 2 "
                r"tensor_parallel_rank node\(s\)"),
    "a size of 1": (tensor_file().replace("tensor_parallel_size = 2", "tensor_parallel_size = 1"),
                    r"'cluster.tensor_parallel_size' is 1 in a file of tensor_parallel_rank "
                    r"nodes: a group splits the model over 2 ranks or more"),
    "more ranks than nodes": (tensor_file().replace("tensor_parallel_size = 2",
                                                    "tensor_parallel_size = 3"),
                              r"'cluster.tensor_parallel_size' is 3, but 2 node\(s\) have role "
                              r"'tensor_parallel_rank' \('node-0', 'node-1'\); no node has "
                              r"rank 2"),
    "too large": (tensor_file().replace("tensor_parallel_size = 2", "tensor_parallel_size = 17"),
                  r"'cluster.tensor_parallel_size' is 17, more than the 16"),
    "a pipeline's size": (tensor_file().replace("pipeline_parallel_size = 1",
                                                "pipeline_parallel_size = 2"),
                          r"'cluster.pipeline_parallel_size' is 2 in a file of "
                          r"tensor_parallel_rank nodes, which are one group of the whole "
                          r"model"),
    "replicas": (tensor_file(extra="replicas = 2"),
                 r"'cluster.replicas' is not for a tensor-parallel group's file"),
    "kv_compression": (tensor_file(extra='kv_compression = "int8"'),
                       r"'cluster.kv_compression' is not for a tensor-parallel group's file"),
    "layers on a rank": (tensor_file(rank0_extra="layers = [0, 2]"),
                         r"node 'node-0': a tensor_parallel_rank node has no 'layers'"),
    "replica on a rank": (tensor_file(rank0_extra="replica = 0"),
                          r"node 'node-0': a tensor_parallel_rank node has no 'replica'"),
    "resources on a rank": (tensor_file(rank0_extra="[nodes.resources]\nmemory_bytes = 1"),
                            r"node 'node-0': a tensor_parallel_rank node has no 'resources'"),
    "a wildcard": (tensor_file().replace("10.0.0.10:19000", "0.0.0.0:19000"),
                   r"node 'node-0': 'address' '0\.0\.0\.0:19000' is a wildcard"),
    "no address": (tensor_file().replace('address = "10.0.0.10:19000"\n', ""),
                   r"node 'node-0': 'address' is missing"),
    "the same address": (tensor_file().replace("10.0.0.10:19000", "studio-2.local:19000"),
                         r"node 'node-0' and node 'node-1' have the same address"),
    "beside a pipeline stage": (
        tensor_file() + '\n[[nodes]]\nid = "s0"\naddress = "10.0.0.30:19100"\n'
        'role = "pipeline_stage"\nrank = 0\nlayers = [0, 2]\n',
        r"node 's0' has role 'pipeline_stage', but the file has tensor_parallel_rank nodes "
        r"too: a pipeline whose stages are tensor-parallel groups is written with role "
        r"pipeline_tensor_parallel nodes \(the 2D mesh\)"),
    "beside a coordinator": (
        tensor_file() + '\n[[nodes]]\nid = "c"\naddress = "10.0.0.30:19000"\n'
        'role = "coordinator"\n',
        r"node 'c' has role 'coordinator', but the file has tensor_parallel_rank nodes too"),
    "beside a router": (
        tensor_file() + '\n[[nodes]]\nid = "r"\naddress = "10.0.0.30"\nrole = "router"\n',
        r"node 'r' has role 'router', but the file has tensor_parallel_rank nodes too: a "
        r"router node beside a tensor-parallel group across hosts is not described"),
    "a rank in a router's file": (
        router_file("tensor_parallel_size = 2").replace(
            'role = "hybrid"', 'role = "tensor_parallel_rank"\nrank = 0', 1),
        r"node 'router' has role 'router', but the file has tensor_parallel_rank nodes too"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_group_is_refused_naming_what(case: str, tmp_path: Path) -> None:
    text, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as info:
        parse_cluster_text(text, tmp_path / "cluster.toml")
    assert str(tmp_path / "cluster.toml") in str(info.value)
    assert info.value.hint


CONTRADICTIONS = {
    "--tp-size on rank 0": ("node-0", {"tp_size": 4},
                            r"^--tp-size 4 contradicts --distributed-config: .*node 'node-0' "
                            r"is rank 0 of the file's tensor-parallel group, whose "
                            r"'cluster\.tensor_parallel_size' is 2"),
    "--tp-size on rank 1": ("node-1", {"tp_size": 2},
                            r"^--tp-size 2 contradicts --distributed-config: .*node 'node-1' "
                            r"is rank 1 of the file's tensor-parallel group, which takes its "
                            r"size from rank 0's daemon"),
    "--tp-peers on rank 0": ("node-0", {"tp_size": 2, "tp_peers": "10.0.0.99"},
                             r"^--tp-peers \(10\.0\.0\.99:19000\) contradicts "
                             r"--distributed-config: .*node 'node-0' says tp_peers = "
                             r"studio-2\.local:19000"),
    "--node-role on rank 1": ("node-1", {"node_role": "hybrid"},
                              r"^--node-role \(hybrid\) contradicts --distributed-config: "
                              r".*node 'node-1' says node_role = tensor_parallel_rank"),
}


@pytest.mark.parametrize("case", CONTRADICTIONS)
def test_a_flag_that_contradicts_the_file_is_refused(case: str, tmp_path: Path) -> None:
    node, flags, message = CONTRADICTIONS[case]
    with pytest.raises(ConfigError, match=message) as info:
        _placed(tmp_path, _setup(tmp_path, tensor_file()), node, **flags)
    assert "drop --" in info.value.hint


@pytest.mark.parametrize("node", ["node-0", "node-1"])
def test_another_node_role_beside_the_file_is_refused(node: str, tmp_path: Path) -> None:
    """As beside a serving cluster's file, a node role other than hybrid is refused before
    the file places the node (config/replicas.py's check_no_pipeline), naming both."""
    with pytest.raises(ConfigError, match=r"^node_role tensor_parallel_rank \(--node-role\) "
                       r"excludes distributed_config \(--distributed-config\)"):
        _placed(tmp_path, _setup(tmp_path, tensor_file()), node,
                node_role="tensor_parallel_rank")


def test_a_serve_key_that_contradicts_the_file_is_refused(tmp_path: Path) -> None:
    base = {**_base(tmp_path), "serve": {"tp_peers": ["10.0.0.99"], "tp_size": 2}}
    with pytest.raises(ConfigError, match=r"^\[serve\] tp_peers \(10\.0\.0\.99:19000\) "
                       r"contradicts --distributed-config"):
        _placed(tmp_path, _setup(tmp_path, tensor_file()), "node-0", base=base)


def test_a_model_the_group_does_not_split_is_refused_on_every_rank(tmp_path: Path) -> None:
    nodes = "".join(f'\n[[nodes]]\nid = "n{r}"\naddress = "10.0.0.{10 + r}"\n'
                    f'role = "tp"\nrank = {r}\n' for r in range(4))
    path = _setup(tmp_path, f'[cluster]\nmodel = "model"\ntensor_parallel_size = 4\n{nodes}')
    for node in ("n0", "n3"):
        with pytest.raises(ConfigError) as info:
            _placed(tmp_path, path, node)
        assert info.value.message.startswith(
            f"{path}: 'cluster.model' with 'cluster.tensor_parallel_size' 4: "
            f"{tmp_path / 'model' / 'config.json'}: tp_size 4 does not divide "
            "num_key_value_heads"), info.value.message


def test_a_rank_without_the_secret_is_refused_naming_the_file_and_the_ring(
        tmp_path: Path) -> None:
    path = _setup(tmp_path, tensor_file())
    cfg = load_cluster(path)
    for node in ("node-0", "node-1"):
        placed = _placed(tmp_path, path, node)
        with pytest.raises(ConfigError) as info:
            require_secret(False, tmp_path / "keys", pp_auto=False, placement=None,
                           tensor=across_hosts(placed.serve.node_role, placed.serve.tp_peers),
                           served=served_node(cfg, node))
        assert info.value.message.startswith(
            f"{served_node(cfg, node)} needs the cluster secret: the ring's ports and ranks "
            "travel over the authenticated agent connection; none was found in the file's "
            "secret_file"), info.value.message
