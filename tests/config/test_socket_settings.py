"""The control socket's settings: the operator group (``--socket-group``, ``[daemon]
socket_group``) and where mlxctl looks for a socket when it is not told."""

from __future__ import annotations

import grp
import socket
from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.control.access import OperatorGroup
from mlxceld.errors import ConfigError
from mlxceld.paths import first_present, socket_candidates

GROUP = grp.getgrgid(0).gr_name  # every Unix has a group 0



def test_the_group_from_the_file_or_the_flag(tmp_path: Path) -> None:
    run = str(tmp_path / "run" / "c.sock")
    state = str(tmp_path / "state")
    cfg = build_config({"daemon": {"socket_group": GROUP, "socket": run, "state_dir": state}},
                       None, Overrides())
    assert cfg.socket_group == OperatorGroup(GROUP, 0)
    cfg = build_config({"daemon": {"socket_group": "nope", "socket": run}}, None,
                       Overrides(socket_group=GROUP, state_dir=Path(state)))
    assert cfg.socket_group == OperatorGroup(GROUP, 0)  # the flag wins
    assert build_config({}, None, Overrides(state_dir=Path(state))).socket_group is None


def test_an_unknown_group_names_the_key_or_the_flag(tmp_path: Path) -> None:
    where = tmp_path / "mlxceld.toml"
    run = str(tmp_path / "run" / "c.sock")
    with pytest.raises(ConfigError) as info:
        build_config({"daemon": {"socket_group": "no-such-group", "socket": run}}, where,
                     Overrides())
    assert str(info.value) == (f"{where}: 'daemon.socket_group' = 'no-such-group': there is "
                               "no group named 'no-such-group' on this host")
    assert "groupadd" in info.value.hint
    with pytest.raises(ConfigError, match=r"^--socket-group no-such-group: there is no group"):
        build_config({}, None, Overrides(socket_group="no-such-group", socket=Path(run)))
    with pytest.raises(ConfigError, match=r"'daemon\.socket_group' must be a non-empty string"):
        build_config({"daemon": {"socket_group": 0}}, where, Overrides())


def test_a_group_socket_in_the_state_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is in the state dir") as info:
        build_config({}, None, Overrides(socket_group=GROUP, state_dir=tmp_path / "st"))
    assert "--socket /run/mlxceld/mlxceld.sock" in info.value.hint


# -- where mlxctl looks ---------------------------------------------------------------------


def test_the_order_on_linux(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    system = tmp_path / "sys" / "mlxceld.sock"
    assert socket_candidates(env, "linux", system_socket=system) == (
        tmp_path / "xdg" / "mlxceld" / "mlxceld.sock", system)
    env["HOMEBREW_PREFIX"] = str(tmp_path / "brew")
    del env["XDG_RUNTIME_DIR"]
    assert socket_candidates(env, "linux", system_socket=system) == (
        tmp_path / ".local" / "state" / "mlxceld" / "mlxceld.sock", system,
        tmp_path / "brew" / "var" / "run" / "mlxceld" / "mlxceld.sock")


def test_the_order_on_macos(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    user = tmp_path / "Library" / "Application Support" / "mlxceld" / "mlxceld.sock"
    system = Path("/Library/Application Support/mlxceld/run/mlxceld.sock")  # the plist's
    assert socket_candidates(env, "darwin") == (
        user, system, Path("/opt/homebrew/var/run/mlxceld/mlxceld.sock"),
        Path("/usr/local/var/run/mlxceld/mlxceld.sock"))
    env["HOMEBREW_PREFIX"] = "/opt/brew"
    assert socket_candidates(env, "darwin") == (
        user, system, Path("/opt/brew/var/run/mlxceld/mlxceld.sock"))


def test_the_first_socket_present_wins(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "xdg"),
           "HOMEBREW_PREFIX": str(tmp_path / "brew")}
    user, system, brew = candidates = socket_candidates(
        env, "linux", system_socket=tmp_path / "sys" / "mlxceld.sock")
    assert first_present(candidates) == user  # none there: the per-user default, to report
    for path in (brew, system, user):
        path.parent.mkdir(parents=True)
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
        assert first_present(candidates) == path
