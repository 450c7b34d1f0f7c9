"""A serving cluster TOML (routers over hybrids, prefill and decode nodes): its rules,
each refusal naming the file, node and field, and its round trip through dump and load."""

from __future__ import annotations

import dataclasses
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
from mlxceld.errors import ConfigError

from helpers.clusterfile import POOLS_FILE, router_file


def parsed(text: str, tmp_path: Path) -> Any:
    return parse_cluster_text(text, tmp_path / "cluster.toml")


def test_a_router_over_hybrids_reads_and_round_trips(tmp_path: Path) -> None:
    cfg = parsed(router_file(), tmp_path)
    assert cfg.serving and needs_secret(cfg)
    assert [(n.id, n.role, n.address) for n in cfg.nodes] == [
        ("router", "router", "10.0.0.10:19000"), ("h1", "hybrid", "studio-2.local:19000"),
        ("h2", "hybrid", "[fd00::13]:19001")]
    path = tmp_path / "out.toml"
    write_cluster(dataclasses.replace(cfg, path=path), path)
    assert load_cluster(path) == dataclasses.replace(cfg, path=path)
    assert "pipeline_parallel_size" not in dump_cluster(cfg)


def test_prefill_and_decode_pools_read_and_round_trip(tmp_path: Path) -> None:
    cfg = parsed(POOLS_FILE, tmp_path)
    assert cfg.kv_compression == "int8+lz4"
    assert parsed(dump_cluster(cfg), tmp_path) == cfg


BAD = {
    "mixed with a pipeline": (router_file(router_extra="\n[[nodes]]\nid = \"s0\"\naddress = "
                                          "\"10.0.0.30:19100\"\nrole = \"pipeline_stage\"\n"
                                          "rank = 0\nlayers = [0, 2]\n"),
                              r"node 's0' has role 'pipeline_stage', but the file has router, "
                              r"hybrid, prefill or decode nodes too"),
    "a router with rank": (router_file(router_extra="rank = 0"),
                           r"node 'router': a router node has no 'rank'"),
    "a hybrid with layers": (router_file().replace('role = "hybrid"',
                                                   'role = "hybrid"\nlayers = [0, 2]', 1),
                             r"node 'h1': a hybrid node has no 'layers'"),
    "pipeline_parallel_size": (router_file(extra="pipeline_parallel_size = 2"),
                               r"'cluster.pipeline_parallel_size' is for a pipeline's cluster"),
    "no router": (router_file().replace('role = "router"', 'role = "hybrid"'),
                  r"no node has role 'router'"),
    "a router alone": (router_file().replace('role = "hybrid"', 'role = "router"'),
                       r"a router needs hybrid nodes \(its replicas\), or prefill and decode"),
    "prefill without decode": (POOLS_FILE.replace('role = "decode"', 'role = "hybrid"'),
                               r"the file has prefill node\(s\) \('p1'\) but no decode node"),
    "same address": (router_file().replace("studio-2.local", "10.0.0.10"),
                     r"node 'router' and node 'h1' have the same address"),
    "same id": (router_file().replace('id = "h2"', 'id = "h1"'),
                r"nodes\[1\] and nodes\[2\] both have id 'h1'"),
    "wildcard": (router_file().replace("studio-2.local", "0.0.0.0"),
                 r"node 'h1': 'address' '0\.0\.0\.0' is a wildcard"),
    "bad compression": (POOLS_FILE.replace("int8+lz4", "int3"),
                        r"'cluster.kv_compression' 'int3' is not a KV compression"),
    "a draft in a serving file": (
        router_file().replace("[cluster]\n", '[cluster]\ndraft_model = "d"\n', 1),
        r"'cluster.draft_model' is for a pipeline's cluster TOML"),
    "compression in a pipeline": (
        '[cluster]\npipeline_parallel_size = 1\nkv_compression = "int8"\n[[nodes]]\n'
        'id = "c"\naddress = "127.0.0.1:19000"\nrole = "coordinator"\n',
        r"'cluster.kv_compression' is for a cluster of routers"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_serving_file_is_refused_naming_what(case: str, tmp_path: Path) -> None:
    text, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as info:
        parsed(text, tmp_path)
    assert str(tmp_path / "cluster.toml") in str(info.value)
    assert info.value.hint
