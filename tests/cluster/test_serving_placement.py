"""A serving cluster TOML's node placed as the equivalent flags place it
(``clusterfile/placement.py``: ``placed_config``), and a flag that contradicts the file
refused naming both."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from mlxceld.cluster.clusterfile.load import load_cluster, select_node
from mlxceld.cluster.clusterfile.placement import placed_config, serving_config
from mlxceld.config.daemon import Overrides, build_config
from mlxceld.errors import ConfigError

from helpers.clusterfile import POOLS_FILE, router_file


def _setup(tmp_path: Path, text: str) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def _base(tmp_path: Path) -> dict[str, Any]:
    return {"daemon": {"state_dir": str(tmp_path / "state")}}


def test_a_placed_router_is_configured_as_the_flags_say(tmp_path: Path) -> None:
    path = _setup(tmp_path, router_file())
    flags = Overrides(distributed_config=path, node_id="router")
    placed = serving_config(build_config(_base(tmp_path), None, flags), flags)
    by_flags = build_config(_base(tmp_path), None, Overrides(
        node_role="router", replicas="studio-2.local,[fd00::13]:19001",
        model=str(tmp_path / "model"), cluster_name="serve-1",
        agent_addr="10.0.0.10:19000"))
    assert placed.serve == by_flags.serve
    assert (placed.cluster_name, placed.agent_addr) == ("serve-1", "10.0.0.10:19000")


def test_placed_pools_are_configured_as_the_flags_say(tmp_path: Path) -> None:
    path = _setup(tmp_path, POOLS_FILE)
    cfg = load_cluster(path)
    expected = {
        "router": Overrides(node_role="router", prefill_peers="10.0.0.21",
                            decode_peers="10.0.0.22:19001,10.0.0.23",
                            kv_compression="int8+lz4"),
        "d1": Overrides(node_role="decode", prefill_peers="10.0.0.21"),
        "p1": Overrides(node_role="prefill"),
    }
    for node_id, flags in expected.items():
        flags = dataclasses.replace(flags, model=str(tmp_path / "model"))
        placed = placed_config(build_config(_base(tmp_path), None, Overrides()), cfg,
                               select_node(cfg, node_id), Overrides())
        assert placed.serve == build_config(_base(tmp_path), None, flags).serve, node_id


def test_a_flag_that_contradicts_the_file_is_refused_naming_both(tmp_path: Path) -> None:
    path = _setup(tmp_path, POOLS_FILE)
    cfg = load_cluster(path)
    for node_id, flags, said in (
            ("router", Overrides(kv_compression="int4"), "--kv-compression"),
            ("p1", Overrides(node_role="hybrid"), "--node-role")):
        base = build_config(_base(tmp_path), None, flags)
        with pytest.raises(ConfigError, match=re.escape(said) + r" \(.*\) contradicts "
                           r"--distributed-config: .*node '" + node_id):
            placed_config(base, cfg, select_node(cfg, node_id), flags)
    with pytest.raises(ConfigError, match=r"--replicas .*--distributed-config|"
                       r"node_role router \(--node-role\) excludes distributed_config"):
        build_config(_base(tmp_path), None, Overrides(
            distributed_config=path, node_id="router", node_role="router", replicas="10.9.9.9"))


def test_a_placed_node_without_a_model_is_refused(tmp_path: Path) -> None:
    path = _setup(tmp_path, router_file().replace('model = "model"\n', ""))
    flags = Overrides(distributed_config=path, node_id="h1")
    with pytest.raises(ConfigError, match=r"\[cluster\] has no 'model' and --model was not "
                       "given"):
        serving_config(build_config(_base(tmp_path), None, flags), flags)
