"""``mlxctl status --check``'s findings from status bodies (``mlxctl/verdict.py``): the
problems status lists, and what is not ready yet without being a problem."""

from __future__ import annotations

import time
from typing import Any

from mlxctl.verdict import findings

DAEMON = {"state": "running"}


def worker(name: str, state: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "role": name, "state": state, "pid": 7, **more}


def test_nothing_wrong_is_healthy() -> None:
    assert findings({"daemon": DAEMON, "workers": [worker("router", "running")],
                     "problems": [], "bringup": {"state": "active"}}) == []


def test_problems_come_first_with_their_next_command_and_are_not_repeated() -> None:
    status = {"daemon": DAEMON, "workers": [worker("stage", "backoff")], "problems": [
        {"subject": "stage", "message": "worker stage is restarting: exited 1",
         "next": "mlxctl logs stage"}]}
    assert findings(status) == ["worker stage is restarting: exited 1; next: mlxctl logs stage"]


def test_not_ready_yet_is_not_healthy() -> None:
    now = time.time()
    loading = {"loading": {"done": 1 << 29, "total": 1 << 30, "since": now - 12}}
    stages = {"stages": [{"stage": "s1", "state": "connecting", "connected": False},
                         {"stage": "s2", "state": "attached", "connected": True}]}
    status = {"daemon": {"state": "stopping"}, "problems": [],
              "workers": [worker("router", "starting", stats=loading),
                          worker("coordinator", "running", stats=stages),
                          worker("tail", "stopping")],
              "bringup": {"state": "pushing"}}
    assert findings(status, now) == [
        "the daemon is stopping",
        "worker router is starting: loading 50% of 1.0 GiB, 12 s",
        "worker tail is stopping",
        "worker coordinator is still connecting to stage s1",
        "a bring-up is in progress (pushing)"]


def test_a_failed_bringup_says_so() -> None:
    status = {"daemon": DAEMON, "workers": [], "problems": [],
              "bringup": {"state": "failed", "summary": "peer 10.0.0.2 refused"}}
    assert findings(status) == ["the last bring-up failed: peer 10.0.0.2 refused; next: "
                                "mlxctl status, mlxctl events"]
