"""`mlxctl serve`'s wait: the router's start as it happens, and how far its model has loaded.

Once the daemon has taken the model (``POST /v1/serve``: it remembers it and starts,
or restarts, its router worker), ``wait_served`` polls the daemon's status every
``POLL_S`` and shows what the router does: each change of its state (``router
starting (pid N)``, ``router backoff: REASON``: it failed and is started again) and,
while it reads its weights, how far it has come, as `mlxctl cluster activate` shows a
peer's stage (``progress.LoadView``): a bar on a terminal, else a line per tenth
(``router: loading 40% of 61.0 GiB, 12 s``). The wait ends when the router runs (the
command prints ``serving NAME at URL (router running)``) or when it cannot: the
router failed or exited (its reason), or a bound passed (exit 1 for all of these).
A model named by a Hugging Face repo id has its weights downloaded first, by the
router, shown the same way (``router: downloading 40% of ...``), then loaded.

Bounds. The whole wait ends at ``--timeout`` (default 600 s, the daemon's own start
timeout for a model worker, ``roster.MODEL_START_TIMEOUT_S``, after which the daemon
kills a router that is not ready and counts a failure; the daemon's counts from the
load's last progress, this one from the start: a download of many GiB needs a larger
``--timeout``, or ``--no-wait`` and ``mlxctl status``). A load that reads nothing
more for ``LOAD_STALL_S`` (60 s, as a stage's load in an assignment) ends the wait
sooner, saying where it stood; the daemon keeps the router starting until its own
timeout (``mlxctl status`` shows it). Each poll is one control request, bounded by
the client's own deadline (``control.exchange.REQUEST_TIMEOUT_S``: 10 s): a daemon
that dies ends the command at once (exit 3, daemon not running), one that stops
answering within that deadline (exit 1, naming it); the bar is taken down first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from mlxceld.control.clients.typed import ControlClient
from mlxceld.types import WorkerState
from mlxctl import render
from mlxctl.progress import LoadView

POLL_S: Final = 0.5
LOAD_STALL_S: Final = 60.0  # a load that reads no more bytes for this long is not waited for
ROUTER: Final = "router"
# The router's start has come to rest: it runs, its supervisor gave up, or it exited.
ENDED: Final = frozenset({WorkerState.RUNNING, WorkerState.FAILED, WorkerState.EXITED})


@dataclass
class Served:
    """How `mlxctl serve` ended: the daemon's answer, the router as last seen, and why it
    does not run (empty when it does)."""

    body: dict[str, Any]
    router: dict[str, Any] = field(default_factory=lambda: {"state": "missing"})
    problem: str = ""


def router_of(workers: list[dict[str, Any]]) -> dict[str, Any]:
    return next((w for w in workers if w["name"] == ROUTER), {"state": "missing"})


def _mark(w: dict[str, Any]) -> tuple[Any, ...]:
    """What changes when the router starts again, whatever its state was."""
    return tuple(w.get(k) for k in ("state", "pid", "restarts", "last_exit", "started_at"))


async def serve_and_wait(c: ControlClient, model: str, name: str | None, timeout: float,
                         view: LoadView | None) -> Served:
    """Ask the daemon to serve ``model``, then wait for its router (module docstring);
    ``view`` None: show nothing (``--json``)."""
    before = _mark(router_of((await c.workers())["workers"]))
    served = Served(await c.serve(model, name))
    serving = served.body.get("serving")
    if not serving:
        served.problem = "the daemon runs no router for it (see: mlxctl status)"
        return served
    step = view.step if view is not None else _quiet
    step(f"serve {serving['model_name']} from {serving['model']}: "
         + ("restarting the router" if before[0] != "missing" else "starting the router"))
    try:
        async with asyncio.timeout(timeout):
            await _follow(c, served, before, view, step)
    except TimeoutError:
        load = render.worker_loading(served.router, time.time())
        served.problem = (f"the router did not run within {timeout:g} s (it is "
                          f"{served.router['state']}" + (f", {load[2]}" if load else "")
                          + "); the daemon goes on starting it (see: mlxctl status)")
    return served


async def _follow(c: ControlClient, served: Served, before: tuple[Any, ...],
                  view: LoadView | None, step: Callable[[str], None]) -> None:
    """Poll until the router's start has come to rest, or its load stalls."""
    loop = asyncio.get_running_loop()
    moved = False  # the router has changed since the serve (a restart begun)
    shown: tuple[Any, Any] = (None, None)  # the state and pid last printed
    pid: Any = None  # the router's process, as last seen
    done, moved_at = (-1, -1), loop.time()  # (step, bytes) as last seen, when they grew
    while True:
        w = router_of((await c.status())["workers"])
        served.router = w
        moved = moved or _mark(w) != before
        if moved and w.get("pid") is not None and w["pid"] != pid:
            if pid is not None:  # another process: its load starts over
                done, moved_at = (-1, -1), loop.time()
                if view is not None:
                    view.restart(ROUTER)
            pid = w["pid"]
        if moved and (w["state"], w.get("pid")) != shown:
            shown = (w["state"], w.get("pid"))
            if w["state"] not in ENDED:
                step(_state_line(w))
        load = render.worker_loading(w, time.time()) if moved else None
        if load is not None:
            if view is not None:
                label = ROUTER if load[3] == "loading" else f"{ROUTER} ({load[3]})"
                view.load(ROUTER, label, *load)
            now = (int(load[3] != "downloading"), load[0])  # downloading, then loading
            if now > done:
                done, moved_at = now, loop.time()
            elif loop.time() - moved_at > LOAD_STALL_S:
                served.problem = (f"the router's load made no progress for {LOAD_STALL_S:g} "
                                  f"s ({load[2]}); the daemon keeps it starting until its "
                                  "start timeout (see: mlxctl status, mlxctl logs router)")
                return
        if moved and w["state"] in ENDED:
            if w["state"] != WorkerState.RUNNING:
                served.problem = (f"the router {w['state']}: "
                                  f"{w.get('reason') or w.get('last_exit') or 'no reason given'}")
            return
        await asyncio.sleep(POLL_S)


def _state_line(w: dict[str, Any]) -> str:
    pid = f" (pid {w['pid']})" if w.get("pid") else ""
    why = f": {w['reason']}" if w.get("reason") and w["state"] != WorkerState.STARTING else ""
    return f"router {w['state']}{pid}{why}"


def _quiet(line: str) -> None:
    pass
