"""``compute_units``, in ``[daemon]`` and a cluster TOML's ``[nodes.resources]``: absent or
0 measures them at start, a number above 0 is declared; anything else is refused by name
(naming the node and the key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.cluster.clusterfile.load import dump_cluster, parse_cluster_text
from mlxceld.config.daemon import Overrides, build_config
from mlxceld.errors import ConfigError


def test_absent_or_zero_measures_and_a_number_is_declared(tmp_path: Path) -> None:
    where = tmp_path / "m.toml"
    assert build_config({}, where, Overrides()).compute_units is None
    assert build_config({"daemon": {"compute_units": 0}}, where,
                        Overrides()).compute_units is None
    assert build_config({"daemon": {"compute_units": 120}}, where,
                        Overrides()).compute_units == 120.0
    assert build_config({"daemon": {"compute_units": 0.5}}, where,
                        Overrides()).compute_units == 0.5


@pytest.mark.parametrize("bad", [-1, -0.5, True, "100", float("nan"), float("inf"), [1]])
def test_a_bad_value_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"'daemon\.compute_units' must be a number of at "
                                          r"least 0, not ") as err:
        build_config({"daemon": {"compute_units": bad}}, tmp_path / "m.toml", Overrides())
    assert "0 measures" in err.value.hint


CLUSTER = """
[cluster]
pipeline_parallel_size = 2

[[nodes]]
id = "coordinator"
address = "127.0.0.1:19000"
role = "coordinator"

[[nodes]]
id = "stage-0"
address = "127.0.0.2:19100"
role = "pipeline_stage"
rank = 0
layers = [0, 2]
[nodes.resources]
memory_bytes = 68719476736
compute_units = 0

[[nodes]]
id = "stage-1"
address = "127.0.0.3:19100"
role = "pipeline_stage"
rank = 1
layers = [2, 4]
[nodes.resources]
compute_units = 12.5
"""


def test_a_cluster_toml_node_reads_and_writes_them(tmp_path: Path) -> None:
    """A node's [nodes.resources] compute_units: kept on the node (0: measured) and written
    back as read; a node without it has none."""
    cfg = parse_cluster_text(CLUSTER, tmp_path / "cluster.toml")
    assert [n.compute_units for n in cfg.stages] == [0.0, 12.5]
    assert cfg.coordinator.compute_units is None
    text = dump_cluster(cfg)
    assert "compute_units = 0.0" in text and "compute_units = 12.5" in text
    assert parse_cluster_text(text, cfg.path) == cfg


@pytest.mark.parametrize(("bad", "shown"), [("-1", "-1"), ('"fast"', "'fast'"),
                                            ("true", "True"), ("nan", "nan")])
def test_a_bad_cluster_toml_value_is_refused_naming_the_node(tmp_path: Path, bad: str,
                                                             shown: str) -> None:
    text = CLUSTER.replace("compute_units = 12.5", f"compute_units = {bad}")
    with pytest.raises(ConfigError, match=rf"node 'stage-1': 'resources\.compute_units' "
                                          rf"must be a number of at least 0, not {shown}$"):
        parse_cluster_text(text, tmp_path / "cluster.toml")
