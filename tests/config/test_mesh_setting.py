"""``--mesh`` / ``[daemon] mesh`` (pp_auto's hosts as stages and tensor groups) and
`mlxctl cluster plan|activate --mesh`: a bad value refused naming the flag or key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import Overrides, build_config
from mlxceld.errors import ConfigError


def flags(args: list[str]) -> Overrides:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        return overrides(ctx.params)


def base(tmp_path: Path, **daemon: object) -> dict[str, object]:
    return {"daemon": {"state_dir": str(tmp_path / "s"), **daemon}}


def test_the_default_is_the_pipeline_and_each_mode_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    assert build_config(base(tmp_path), path, flags(["--pp-auto", "4"])).mesh == "pp"
    for mode in ("pp", "tp", "2d", "auto"):
        assert build_config(base(tmp_path), path,
                            flags(["--pp-auto", "4", "--mesh", mode])).mesh == mode
    # the flag wins over the key
    cfg = build_config(base(tmp_path, mesh="tp"), path, flags(["--pp-auto", "4", "--mesh",
                                                                "2d"]))
    assert cfg.mesh == "2d"


@pytest.mark.parametrize(("daemon", "args", "named"), [
    ({}, ["--pp-auto", "4", "--mesh", "ring"], "--mesh 'ring' is not a mesh"),
    ({"mesh": 2}, ["--pp-auto", "4"], "'daemon.mesh' 2 is not a mesh"),
    ({"mesh": "TP"}, ["--pp-auto", "4"], "'daemon.mesh' 'TP' is not a mesh"),
    ({}, ["--mesh", "tp"], "--mesh is for pp_auto (--pp-auto N) only"),
    ({"mesh": "auto"}, [], "'daemon.mesh' is for pp_auto"),
])
def test_a_bad_mesh_is_refused_by_name(tmp_path: Path, daemon: dict[str, object],
                                       args: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(base(tmp_path, **daemon), tmp_path / "m.toml", flags(args))
    assert named in err.value.message


def test_mlxctl_refuses_a_bad_mesh_before_asking(tmp_path: Path) -> None:
    """Exit 2 naming --mesh, without a daemon to ask (the socket does not exist)."""
    for command in ("plan", "activate"):
        done = subprocess.run(
            [sys.executable, "-m", "mlxctl", "--socket", str(tmp_path / "none.sock"),
             "cluster", command, "--model", str(tmp_path), "--stages", "4", "--mesh",
             "ring"], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, done.stderr
        assert "--mesh" in done.stderr and "'ring' is not a mesh" in done.stderr
