"""What a reload changes: two ``Config``s compared setting by setting, for `mlxctl reload`'s
answer and the daemon's log (``daemon/root.py``'s ``_reload``).

A setting is named as the config file names it where the two agree (``serve.port``,
``daemon.log_level``, ``supervisor.health_interval_s``, ``workers.NAME``) and by its field
otherwise (``policy.backoff_max_s``, ``liveness.ping_interval_s``). A value is shown as
JSON can carry it: a path as its text, a tuple as a list, the socket group by name, a
worker's table as its role. Nothing here holds a secret: the config names files; the API
key read from its file is ``serve.api_key`` when it changed, its values ``HIDDEN`` (None
where there is no key).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Final, TypedDict

from mlxceld.config.daemon import Config
from mlxceld.control.access import OperatorGroup

# Read at start only: a reload that changes them says so, and they take effect at the next.
AT_NEXT_START: Final = ("daemon.state_dir", "daemon.socket", "daemon.socket_group",
                        "daemon.log_file", "daemon.log_format", "daemon.log_max_bytes",
                        "daemon.log_backups", "daemon.metrics_listen",
                        "daemon.cluster_interface")
HIDDEN: Final = "(hidden)"  # what a changed API key shows instead of the key
# The fields named after their [daemon] key rather than their own.
_RENAMED: Final = {"log_file_max_bytes": "log_max_bytes", "log_file_backups": "log_backups"}
# The fields named after their [supervisor] key rather than their own.
_SUPERVISOR: Final = ("health_interval_s", "log_max_bytes", "log_backups")
_DAEMON_SKIP: Final = ("config_file", "dry_run", "reset_state", "cluster_secret_origin")


class Change(TypedDict):
    key: str
    old: Any
    new: Any


def config_changes(old: Config, new: Config) -> list[Change]:
    """Every setting whose value differs, in the order of ``Config``'s fields."""
    found: list[Change] = []
    for f in dataclasses.fields(Config):
        if f.name in _DAEMON_SKIP:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        if f.name == "workers":
            found += _workers(a, b)
        elif dataclasses.is_dataclass(a) and not isinstance(a, OperatorGroup):
            found += _nested(f.name, a, b)
        else:
            table = "supervisor" if f.name in _SUPERVISOR else "daemon"
            name = _RENAMED.get(f.name, f.name)
            found.append(Change(key=f"{table}.{name}", old=plain(a), new=plain(b)))
    return found


def api_key_change(old: str | None, new: str | None) -> list[Change]:
    """``serve.api_key`` where the key read from ``[serve] api_key_file`` changed."""
    if old == new:
        return []
    return [Change(key="serve.api_key", old=None if old is None else HIDDEN,
                   new=None if new is None else HIDDEN)]


def _nested(prefix: str, a: Any, b: Any) -> list[Change]:
    return [Change(key=f"{prefix}.{f.name}", old=plain(getattr(a, f.name)),
                   new=plain(getattr(b, f.name)))
            for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]


def _workers(a: tuple[Any, ...], b: tuple[Any, ...]) -> list[Change]:
    """A worker added, removed or changed: ``workers.NAME``, its role before and after
    (None where it is not there)."""
    before, after = {w.name: w for w in a}, {w.name: w for w in b}
    return [Change(key=f"workers.{name}",
                   old=before[name].role if name in before else None,
                   new=after[name].role if name in after else None)
            for name in sorted(before.keys() | after.keys())
            if before.get(name) != after.get(name)]


def plain(value: Any) -> Any:
    """``value`` as JSON carries it."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, OperatorGroup):
        return value.name
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)
