"""A daemon's place in a cluster TOML: checked against the model before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxceld.cluster.clusterfile.placement import pipeline_options, place, stage_options
from mlxceld.errors import ConfigError, UnsupportedFamily
from mlxceld.models import model_identity
from mlxceld.models.families import SUPPORTED

from helpers.clusterfile import write_cluster_toml


def test_stage_and_router_options(tmp_path: Path, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    path = write_cluster_toml(tmp_path, model, [(0, 1), (1, 3), (3, 4)])
    middle = place(path, "s1")
    assert not middle.is_coordinator and middle.needs_secret
    opts = stage_options(middle)
    assert opts.layers == (1, 3) and opts.rank == 1 and not opts.standby
    assert opts.upstream == "127.0.0.2:19100" and opts.downstream == "127.0.0.4:19102"
    assert opts.coordinator == "127.0.0.1:19000"
    assert opts.model_identity == model_identity(model)
    assert opts.first is None and opts.last is None  # only the ends of the ring have them
    assert stage_options(middle, standby=True).standby
    first, last = stage_options(place(path, "s0")), stage_options(place(path, "s2"))
    assert first.upstream is None and last.downstream is None
    assert first.last == "127.0.0.4:19102" and last.first == "127.0.0.2:19100"
    pipe = pipeline_options(place(path, "coord"))
    assert [s.layers for s in pipe.stages] == [(0, 1), (1, 3), (3, 4)]
    assert [s.address for s in pipe.stages] == ["127.0.0.2:19100", "127.0.0.3:19101",
                                                "127.0.0.4:19102"]
    assert pipe.coordinator == "127.0.0.1:19000"


def test_the_draft_goes_to_the_last_stage(tmp_path: Path, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    path = write_cluster_toml(tmp_path, model, [(0, 1), (1, 3), (3, 4)])
    path.write_text(path.read_text().replace(
        "[cluster]\n", "[cluster]\ndraft_model = \"draft\"\nnum_draft_tokens = 3\n", 1))
    last = stage_options(place(path, "s2"))
    assert (last.draft_model, last.num_draft_tokens) == (str(tmp_path / "draft"), 3)
    assert stage_options(place(path, "s0")).draft_model is None
    assert stage_options(place(path, "s1")).draft_model is None


def test_layers_checked_against_the_model(tmp_path: Path, split_fixture_dir: Path) -> None:
    path = write_cluster_toml(tmp_path, split_fixture_dir / "llama", [(0, 2), (2, 3)])
    with pytest.raises(ConfigError, match=r"layer 3 is on no stage|layers 3"):
        place(path, "s0")


def test_a_model_is_required(tmp_path: Path, split_fixture_dir: Path) -> None:
    path = write_cluster_toml(tmp_path, None, [(0, 2), (2, 4)])
    with pytest.raises(ConfigError, match="--model"):
        place(path, "s0")
    assert place(path, "s0", str(split_fixture_dir / "llama")).node.id == "s0"


def test_a_family_not_split_is_refused_naming_the_file(tmp_path: Path,
                                                       split_fixture_dir: Path) -> None:
    model = tmp_path / "mamba"
    model.mkdir()
    config = json.loads((split_fixture_dir / "llama" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    path = write_cluster_toml(tmp_path, model, [(0, 2), (2, 4)])
    with pytest.raises(UnsupportedFamily, match=f"^{path}: .*model_type 'mamba'") as info:
        place(path, "s0")  # no weight file there: refused before any is looked for
    assert all(f in info.value.message for f in SUPPORTED)


def test_an_unknown_node_id_lists_the_known_ones(tmp_path: Path,
                                                 split_fixture_dir: Path) -> None:
    path = write_cluster_toml(tmp_path, split_fixture_dir / "llama", [(0, 2), (2, 4)])
    with pytest.raises(ConfigError, match="'coord', 's0', 's1'"):
        place(path, "nobody")


def test_the_daemon_does_not_import_mlx() -> None:
    code = ("import sys, mlxceld.daemon.root, mlxceld.cluster.clusterfile.placement, "
            "mlxceld.pipeline; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
