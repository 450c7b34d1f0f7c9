"""Default locations of the daemon's files, per platform (see DESIGN.md, Defaults), and
where mlxctl looks for the daemon's control socket.

The functions take the environment (and the platform) as arguments, defaulting to this
process's, so that every rule can be tried without the directories it names.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

APP = "mlxceld"
SYSTEM_SOCKET = Path("/run/mlxceld/mlxceld.sock")  # the systemd unit's RuntimeDirectory=
# The launchd system daemon's (contrib/launchd/system): beside its state dir, in a directory
# of the operator group's.
MACOS_SYSTEM_SOCKET = Path("/Library/Application Support/mlxceld/run/mlxceld.sock")
BREW_PREFIXES = (Path("/opt/homebrew"), Path("/usr/local"))  # Apple silicon, Intel


def _home(environ: Mapping[str, str]) -> Path:
    home = environ.get("HOME")
    return Path(home) if home else Path.home()  # (Path.home() asks the password database)


def default_state_dir(environ: Mapping[str, str] | None = None,
                      platform: str = sys.platform) -> Path:
    """``~/.local/state/mlxceld`` on Linux, ``~/Library/Application Support/mlxceld`` on macOS.

    Under systemd the unit sets ``STATE_DIRECTORY`` (from ``StateDirectory=``), which wins.
    """
    environ = os.environ if environ is None else environ
    systemd = environ.get("STATE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    if platform == "darwin":
        return _home(environ) / "Library" / "Application Support" / APP
    base = environ.get("XDG_STATE_HOME") or str(_home(environ) / ".local" / "state")
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


def default_socket(state_dir: Path, environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/mlxceld/mlxceld.sock``, else ``<state-dir>/mlxceld.sock``."""
    environ = os.environ if environ is None else environ
    systemd = environ.get("RUNTIME_DIRECTORY")  # systemd's RuntimeDirectory=, already ours
    if systemd:
        return Path(systemd.split(":")[0]) / f"{APP}.sock"
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime.split(":")[0]) / APP / f"{APP}.sock"
    return state_dir / f"{APP}.sock"


def socket_candidates(environ: Mapping[str, str] | None = None, platform: str = sys.platform,
                      *, system_socket: Path | None = None,
                      brew_prefixes: Sequence[Path] = BREW_PREFIXES) -> tuple[Path, ...]:
    """Where mlxctl looks, in order, when neither ``--socket`` nor ``MLXCELD_SOCKET`` says:

    1. the per-user daemon's default (``default_socket`` of ``default_state_dir``);
    2. the system daemon's: on Linux ``/run/mlxceld/mlxceld.sock`` (the systemd unit's),
       on macOS ``/Library/Application Support/mlxceld/run/mlxceld.sock`` (the launchd
       system plist's);
    3. Homebrew's service: ``<prefix>/var/run/mlxceld/mlxceld.sock``, the prefix from
       ``HOMEBREW_PREFIX`` (``brew shellenv`` sets it), else on macOS ``/opt/homebrew``
       and ``/usr/local``.
    """
    environ = os.environ if environ is None else environ
    found = [default_socket(default_state_dir(environ, platform), environ)]
    if platform.startswith("linux"):
        found.append(system_socket or SYSTEM_SOCKET)
    elif platform == "darwin":
        found.append(system_socket or MACOS_SYSTEM_SOCKET)
    brew = environ.get("HOMEBREW_PREFIX")
    prefixes = [Path(brew)] if brew else list(brew_prefixes) if platform == "darwin" else []
    found += [prefix / "var" / "run" / APP / f"{APP}.sock" for prefix in prefixes]
    return tuple(dict.fromkeys(found))


def first_present(candidates: Sequence[Path]) -> Path:
    """The first candidate that is there, else the first one.

    One we may not look at counts as there (a system socket in a directory of a group we
    are not in): connecting to it tells the user which group to join.
    """
    for path in candidates:
        try:
            os.lstat(path)
        except PermissionError:
            return path
        except OSError:
            continue
        return path
    return candidates[0]


def client_socket() -> Path:
    """Where mlxctl looks when neither ``--socket`` nor ``MLXCELD_SOCKET`` is given."""
    return first_present(socket_candidates())
