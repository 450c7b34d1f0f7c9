"""``WorkerView``: one worker as the supervisor shows it (``Supervisor.snapshot``).

A typed answer of the control API (`mlxctl workers`, each row of `mlxctl status`'s
``workers``): built once here, written once by ``to_json``, whose dict is what went on the
control socket before it was typed (its keys in that order; ``loading`` only while a
starting worker says how far its load is).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxceld.types import JSON, LoadProgress, WorkerKeys, WorkerState


@dataclass(frozen=True)
class WorkerView:
    name: str
    role: str
    group: str | None  # the group it starts and stops with (``groups.py``)
    state: WorkerState
    pid: int | None
    healthy: bool | None  # its last health probe; None unless it runs
    reason: str  # why it is in its state
    restarts: int
    last_exit: str  # its last exit, in a line ("" before any)
    started_at: float | None  # unix s
    rss_bytes: int | None
    log: str  # its log file
    keys: WorkerKeys | None  # its keyring's key ids, as it last reported them
    loading: LoadProgress | None = None  # while it starts and says so

    def to_json(self) -> JSON:
        out: JSON = {
            "name": self.name, "role": self.role, "group": self.group,
            "state": self.state.value, "pid": self.pid, "healthy": self.healthy,
            "reason": self.reason, "restarts": self.restarts, "last_exit": self.last_exit,
            "started_at": self.started_at, "rss_bytes": self.rss_bytes, "log": self.log,
            "keys": dict(self.keys) if self.keys is not None else None,
        }
        if self.loading is not None:
            out["loading"] = dict(self.loading)
        return out
