"""`mlxctl serve`'s wait (``mlxctl/serving.py``) over a scripted daemon: it waits past the
router that ran before the serve, follows a load and its restarts, and ends with a reason
when the router fails, its load stalls or the whole wait runs out."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from mlxceld.control.clients.typed import ControlClient
from mlxctl import serving
from mlxctl.progress import LoadView

SERVING = {"model": "/m/llama", "model_name": "llama", "url": "http://127.0.0.1:8080/v1",
           "api_key": False}


def router(state: str, pid: int | None = 10, *, done: int | None = None,
           total: int = 10 << 20, reason: str = "", restarts: int = 0) -> dict[str, Any]:
    stats = (None if done is None else
             {"loading": {"done": done, "total": total, "since": time.time() - 2}})
    return {"name": "router", "role": "router", "state": state, "pid": pid, "reason": reason,
            "restarts": restarts, "last_exit": "", "started_at": 1.0, "stats": stats}


class ScriptedDaemon:
    """The control client's calls the wait makes: ``workers`` (before the serve), ``serve``,
    then ``status`` answering each of ``script`` in turn (the last one forever)."""

    def __init__(self, before: dict[str, Any] | None, script: list[dict[str, Any]]) -> None:
        self.before, self.script, self.polls = before, script, 0

    async def workers(self) -> dict[str, Any]:
        return {"workers": [self.before] if self.before else []}

    async def serve(self, model: str, name: str | None) -> dict[str, Any]:
        return {"serving": SERVING}

    async def status(self) -> dict[str, Any]:
        w = self.script[min(self.polls, len(self.script) - 1)]
        self.polls += 1
        return {"workers": [w]}


def wait(daemon: ScriptedDaemon, timeout: float = 30.0) -> tuple[serving.Served, list[str]]:
    lines: list[str] = []
    view = LoadView(lines.append)
    served = asyncio.run(serving.serve_and_wait(cast(ControlClient, daemon), "/m/llama", None,
                                                timeout, view))
    view.close()
    return served, lines


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "POLL_S", 0.01)


def test_a_restart_is_waited_past_the_old_router_and_its_load_shown() -> None:
    old = router("running", 10)
    daemon = ScriptedDaemon(old, [old, old, router("stopping", 10), router("starting", 11),
                                  router("starting", 11, done=0), router("starting", 11,
                                                                         done=5 << 20),
                                  router("starting", 11, done=10 << 20),
                                  router("running", 11)])
    served, lines = wait(daemon)
    assert served.problem == "" and served.router["pid"] == 11
    assert lines[0] == "serve llama from /m/llama: restarting the router"
    assert lines[1:3] == ["router stopping (pid 10)", "router starting (pid 11)"]
    assert [line.split("% of")[0] for line in lines[3:]] == [
        "router: loading 0", "router: loading 50", "router: loading 100"]


def test_a_router_that_starts_again_loads_from_zero_again() -> None:
    daemon = ScriptedDaemon(None, [router("starting", 11, done=9 << 20),
                                   router("backoff", None, reason="exited 1: out of memory"),
                                   router("starting", 12, done=0), router("running", 12)])
    served, lines = wait(daemon)
    assert served.problem == ""
    assert lines == ["serve llama from /m/llama: starting the router",
                     "router starting (pid 11)", lines[2], "router backoff: exited 1: out of "
                     "memory", "router starting (pid 12)", lines[5]]
    assert "loading 90%" in lines[2] and "loading 0%" in lines[5]


def test_a_failed_router_ends_the_wait_with_its_reason() -> None:
    daemon = ScriptedDaemon(None, [router("starting", 11),
                                   router("failed", None, reason="cannot load model: bad")])
    served, _ = wait(daemon)
    assert served.problem == "the router failed: cannot load model: bad"


def test_a_load_that_stalls_ends_the_wait_naming_where(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "LOAD_STALL_S", 0.2)
    daemon = ScriptedDaemon(None, [router("starting", 11, done=3 << 20)])
    begun = time.monotonic()
    served, _ = wait(daemon)
    assert time.monotonic() - begun < 5
    assert served.problem.startswith("the router's load made no progress for 0.2 s "
                                     "(router: loading 30% of 10.0 MiB, 2 s)")
    assert "start timeout" in served.problem


def test_the_whole_wait_is_bounded() -> None:
    daemon = ScriptedDaemon(None, [router("starting", 11)])  # never loads, never runs
    begun = time.monotonic()
    served, _ = wait(daemon, timeout=0.3)
    assert time.monotonic() - begun < 5
    assert served.problem == ("the router did not run within 0.3 s (it is starting); the "
                              "daemon goes on starting it (see: mlxctl status)")


def test_no_router_to_wait_for_is_said_at_once() -> None:
    daemon = ScriptedDaemon(None, [router("starting")])

    async def nothing(model: str, name: str | None) -> dict[str, Any]:
        return {"serving": None}

    daemon.serve = nothing  # type: ignore[method-assign]
    served, lines = wait(daemon)
    assert served.problem.startswith("the daemon runs no router for it")
    assert daemon.polls == 0 and lines == []
