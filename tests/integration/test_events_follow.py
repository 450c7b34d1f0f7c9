"""``mlxctl events -f --json`` against a real daemon: one ``mlxctl.event/1`` object a
line, every transition in order as it happens, Ctrl-C ends it with 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons
from helpers.waiting import wait_for

ONE_ECHO = FAST_POLICY + """
[workers.alpha]
role = "echo"
options = { interval_s = 0.2 }
"""
SEEN_WITHIN_S = 10.0  # a transition reaches a follower within this (it takes ms; slack)


class Follower:
    """``mlxctl events -f --json`` as a subprocess, its lines read on a thread."""

    def __init__(self, d: DaemonProc, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxctl", "--socket", str(d.socket), "events", "-f",
             "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "NO_COLOR": "1"})
        self.lines: list[tuple[float, str]] = []
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,),
                                        daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append((time.time(), line))  # beside each event's ts (wall clock)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for _, line in list(self.lines)]

    def wait(self, what: str, check: Any, timeout: float = SEEN_WITHIN_S) -> dict[str, Any]:
        found: dict[str, Any] = wait_for(
            lambda: next((e for e in self.events() if check(e)), None), timeout, what)
        return found

    def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=10)
        self._reader.join(5)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def test_follow_json_streams_every_transition_and_ends_on_ctrl_c(daemons: Daemons) -> None:
    d = daemons.make(ONE_ECHO).start()
    first = d.wait_worker("alpha", state="running")["pid"]
    daemons.pids.add(first)
    f = Follower(d, "-n", "3")
    try:
        f.wait("the last 3 past events", lambda e: len(f.lines) >= 3)
        past = f.events()
        assert d.ctl("restart", "alpha").returncode == 0
        f.wait("alpha running again", lambda e: e["kind"] == "worker.running"
               and e["subject"] == "alpha" and e["id"] > past[-1]["id"])
        code, err = f.interrupt()
    finally:
        f.kill()
    assert code == 130, err
    assert "Traceback" not in err
    events = f.events()
    assert all(e["schema"] == "mlxctl.event/1" for e in events)
    assert all(set(e) == {"schema", "id", "ts", "kind", "subject", "message", "data"}
               for e in events)
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert len(past) == 3
    # Every transition the daemon recorded meanwhile reached the follower, in order.
    recorded = [e for e in d.events() if e["id"] > past[-1]["id"] and e["id"] <= ids[-1]]
    assert [e["id"] for e in events[3:]] == [e["id"] for e in recorded]
    kinds = [e["kind"] for e in events[3:] if e["subject"] == "alpha"]
    assert kinds[:4] == ["worker.restart_requested", "worker.stopping", "worker.starting",
                         "worker.spawned"], kinds
    assert "worker.running" in kinds
    stopping = next(e for e in events if e["kind"] == "worker.stopping")
    assert stopping["data"]["old"] == "running" and stopping["data"]["new"] == "stopping"
    # How long each new event took from the daemon's append to the follower's stdout.
    lags = [t - json.loads(line)["ts"] for t, line in f.lines[3:]]
    print(f"append to follower: {len(lags)} events, max {max(lags) * 1000:.0f} ms")
    assert max(lags) < SEEN_WITHIN_S
