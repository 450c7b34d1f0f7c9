"""``mlxctl status --check``: whether the daemon is healthy, as an exit code for scripts.

Healthy (exit 0) means nothing below holds; degraded (exit 1) prints each finding on a
line of its own, on stdout:

- every problem ``mlxctl status`` lists (``problems``: a worker failed, restarting or
  exited, one that fails its health probes, a stage or replica the router cannot use, a
  peer of the plan suspect or dead, a peer on a stale key, a failed rotation, ...), as
  ``MESSAGE; next: COMMAND``;
- the daemon is stopping;
- a worker not running yet, or stopping (``worker router is starting: loading 43% of
  ...``): a router still loading its model serves nothing yet;
- a stage the router is still connecting to (the problems leave that one out: it is not
  yet a failure);
- a bring-up in progress (planning, pushing, resuming at start) or one that failed.

So ``until mlxctl status --check; do sleep 2; done`` waits until a model is served.
Exit 3: the daemon cannot be reached (not running, or no answer within the control
client's deadline); 4: permission denied on its socket; 2: usage. Pure, apart from
``check``: ``findings`` reads a status body as ``GET /v1/status`` answers it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Final

from mlxceld.control.clients.blocking import BlockingClient
from mlxceld.errors import ControlError, PermissionDenied
from mlxceld.types import WorkerState
from mlxctl import render
from mlxctl.edge import EXIT_DENIED, EXIT_FAILURE, EXIT_NOT_RUNNING, emit, fail

HEALTHY: Final = 0
DEGRADED: Final = EXIT_FAILURE
BRINGUP_BUSY: Final = frozenset({"planning", "pushing", "resuming"})


def findings(status: dict[str, Any], now: float | None = None) -> list[str]:
    """What keeps the daemon from being healthy, a line each (the module's list)."""
    now = time.time() if now is None else now
    out: list[str] = []
    if status["daemon"].get("state") == "stopping":
        out.append("the daemon is stopping")
    problems = status.get("problems") or []
    out += [f"{p['message']}; next: {p['next']}" for p in problems]
    named = {p.get("subject") for p in problems}
    for w in status.get("workers") or []:
        if w["state"] == WorkerState.RUNNING or w["name"] in named:
            continue
        if w["state"] in (WorkerState.STARTING, WorkerState.STOPPING):
            load = render.worker_loading(w, now)
            out.append(f"worker {w['name']} is {w['state']}"
                       + (f": {load[2].split(': ', 1)[1]}" if load else ""))
    for w in status.get("workers") or []:
        if w["state"] == WorkerState.RUNNING:
            for s in (w.get("stats") or {}).get("stages") or []:
                if not s.get("connected") and s.get("state") == "connecting":
                    out.append(f"worker {w['name']} is still connecting to stage "
                               f"{s['stage']}")
    bringup = status.get("bringup") or {}
    if bringup.get("state") in BRINGUP_BUSY:
        out.append(f"a bring-up is in progress ({bringup['state']})")
    elif bringup.get("state") == "failed":
        out.append("the last bring-up failed" + (f": {bringup['summary']}"
                                                 if bringup.get("summary") else "")
                   + "; next: mlxctl status, mlxctl events")
    return out


def check(path: Path, as_json: bool) -> int:
    """Ask the daemon once; print the findings (or ``healthy``); the exit code."""
    try:
        with BlockingClient(path) as client:
            status = client.status()
    except PermissionDenied as exc:
        fail(as_json, EXIT_DENIED, exc.code, exc.message, exc.hint)
    except ControlError as exc:  # not running, or no answer in time: cannot be reached
        fail(as_json, EXIT_NOT_RUNNING, exc.code, exc.message, exc.hint)
    found = findings(status)
    emit(as_json, "check", {"healthy": not found, "findings": found},
         lambda: "\n".join(found) if found else "healthy")
    return DEGRADED if found else HEALTHY
