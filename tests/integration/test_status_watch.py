"""``mlxctl status --check`` and ``--watch`` against real daemons: the exit code follows
what status lists as unhealthy (a router that stops answering, a worker that failed, a
daemon that is not there), and the live view prints a snapshot per interval, says when
the daemon stops answering and goes on, and ends on Ctrl-C with 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.ports import free_port
from helpers.waiting import wait_for

ONE_ECHO = FAST_POLICY + """
[workers.alpha]
role = "echo"
options = { interval_s = 3600 }
"""
FLAPPY = FAST_POLICY + """
[workers.flappy]
role = "echo"
options = { crash_after_s = 0.1 }
flap_max_exits = 3
flap_window_s = 60.0
"""


def check(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return d.ctl("status", "--check", *args)


def test_check_is_0_when_serving_and_1_while_the_router_does_not_answer(
        daemons: Daemons, fixture_dir: Path) -> None:
    d = daemons.make(FAST_POLICY).start("--model", str(fixture_dir / "llama"),
                                        "--port", str(free_port()))
    starting = check(d)
    router = d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(router["pid"])
    if starting.returncode:  # asked before the router ran: said so
        assert "worker router is starting" in starting.stdout, starting.stdout
    wait_for(lambda: d.worker("router").get("healthy") is not False, 30, "a healthy router")
    ok = check(d)
    assert (ok.returncode, ok.stdout) == (0, "healthy\n"), ok.stdout + ok.stderr
    assert json.loads(check(d, "--json").stdout) == {
        "healthy": True, "findings": [], "schema": "mlxctl.check/1"}
    os.kill(router["pid"], signal.SIGSTOP)  # it stops answering its health probes
    try:
        wait_for(lambda: (w := d.worker("router"))["state"] != "running"
                 or w.get("healthy") is False, 60, "the stopped router seen unhealthy")
        bad = check(d)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the daemon may have killed it
            os.kill(router["pid"], signal.SIGCONT)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "worker router" in bad.stdout and bad.stdout != "healthy\n"
    again = d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(again["pid"])
    wait_for(lambda: check(d).returncode == 0, READY_S, "healthy again")


def test_check_lists_a_failed_worker_and_3_without_a_daemon(daemons: Daemons) -> None:
    d = daemons.make(FLAPPY).start()
    d.wait_worker("flappy", timeout=30, state="failed")
    out = check(d)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("worker flappy failed: exited 3 times")
    assert lines[0].endswith("; next: mlxctl logs flappy; then: mlxctl restart flappy")
    body = json.loads(check(d, "--json").stdout)
    assert body["healthy"] is False and body["findings"] == lines
    gone = d.ctl("--socket", str(d.root / "none.sock"), "status", "--check")
    assert gone.returncode == 3 and "mlxceld is not running" in gone.stderr
    usage = d.ctl("status", "--check", "--watch")
    assert usage.returncode == 2 and "--watch" in usage.stderr


class Watcher:
    """``mlxctl status --watch`` as a subprocess (not a terminal), its lines read on a
    thread."""

    def __init__(self, d: DaemonProc, *args: str) -> None:
        # As from a terminal, ^C not ignored (a suite run as a background job ignores
        # SIGINT, and a child inherits that).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlxctl", "--socket", str(d.socket), "status",
                 "--watch", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env={**os.environ, "NO_COLOR": "1"})
        finally:
            signal.signal(signal.SIGINT, previous)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def count(self, predicate: str, at_least: int, timeout: float = 60) -> None:
        wait_for(lambda: sum(predicate in line for line in list(self.lines)) >= at_least,
                 timeout, f"{at_least} lines with {predicate!r}")

    def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module")
def echo_daemon() -> Iterator[DaemonProc]:
    """One daemon for the two watch tests: the one that stops it (SIGSTOP) resumes it."""
    owner = Daemons()
    try:
        d = owner.make(ONE_ECHO).start()
        owner.pids.add(d.wait_worker("alpha", state="running")["pid"])
        yield d
    finally:
        owner.end()


def test_watch_prints_snapshots_survives_a_silent_daemon_and_ends_on_ctrl_c(
        echo_daemon: DaemonProc) -> None:
    d = echo_daemon
    w = Watcher(d, "--interval", "1")
    try:
        w.count("--- ", 2)
        w.count("health: ok", 2)
        os.kill(d.pid, signal.SIGSTOP)  # the daemon stops answering: the view goes on
        try:
            w.count("daemon not answering (since ", 1, timeout=60)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        seen = len(w.lines)
        wait_for(lambda: any("health: ok" in line for line in w.lines[seen:]), 60,
                 "the status again once the daemon answers")
        code, err = w.interrupt()
    finally:
        w.kill()
    assert code == 0, err
    text = "\n".join(w.lines)
    assert text.startswith("--- ") and "alpha" in text and "still trying" in text


def test_watch_json_is_a_status_object_a_line(echo_daemon: DaemonProc) -> None:
    w = Watcher(echo_daemon, "--json", "--interval", "0.5")
    try:
        w.count("mlxctl.status/1", 2)
        code, err = w.interrupt()
    finally:
        w.kill()
    assert code == 0, err
    bodies = [json.loads(line) for line in w.lines]
    assert len(bodies) >= 2 and all(b["schema"] == "mlxctl.status/1" for b in bodies)
    assert bodies[0]["workers"][0]["name"] == "alpha"
