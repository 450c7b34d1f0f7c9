"""Default locations of the daemon's files, per platform (see DESIGN.md, Defaults)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP = "mlxceld"


def default_state_dir() -> Path:
    """``~/.local/state/mlxceld`` on Linux, ``~/Library/Application Support/mlxceld`` on macOS.

    Under systemd the unit sets ``STATE_DIRECTORY`` (from ``StateDirectory=``), which wins.
    """
    systemd = os.environ.get("STATE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / APP


def default_config_file() -> Path:
    """``mlxceld.toml`` in the platform's config dir (XDG on Linux, Application Support, macOS)."""
    systemd = os.environ.get("CONFIGURATION_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0]) / f"{APP}.toml"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP / f"{APP}.toml"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / APP / f"{APP}.toml"


def default_socket(state_dir: Path) -> Path:
    """``$XDG_RUNTIME_DIR/mlxceld/mlxceld.sock``, else ``<state-dir>/mlxceld.sock``."""
    systemd = os.environ.get("RUNTIME_DIRECTORY")  # systemd's RuntimeDirectory=, already ours
    if systemd:
        return Path(systemd.split(":")[0]) / f"{APP}.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime.split(":")[0]) / APP / f"{APP}.sock"
    return state_dir / f"{APP}.sock"


def client_socket() -> Path:
    """Where mlxctl looks when neither ``--socket`` nor ``MLXCELD_SOCKET`` is given."""
    return default_socket(default_state_dir())
