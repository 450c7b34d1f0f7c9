"""``mlxctl events -f --json`` against a real daemon: one ``mlxctl.event/1`` object a
line, every transition in order as it happens, Ctrl-C ends it with 130."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from typing import IO, Any

import psutil

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
        # As from a terminal, ^C not ignored: a suite run as a background job of a script
        # ignores SIGINT, and a child inherits that (an exec resets only a handler).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlxctl", "--socket", str(d.socket), "events", "-f",
                 "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "NO_COLOR": "1"})
        finally:
            signal.signal(signal.SIGINT, previous)
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


STALLED_EVENTS = 8_000
EVENT_BYTES = 2048  # each event's message: 16 MiB of lines in all, far above the buffers


def test_a_follower_that_stops_reading_costs_buffers_only_and_loses_nothing(
        daemons: Daemons) -> None:
    """The stream waits for its reader (it keeps a position, no queue): the daemon's memory
    stays flat however far the reader falls behind, and when it reads again every event
    comes, in order. The events are written to the daemon's own table (WAL) so that 8,000
    take a moment; a restart's events wake the stream."""
    d = daemons.make(ONE_ECHO).start()
    daemons.pids.add(d.wait_worker("alpha", state="running")["pid"])
    daemon = psutil.Process(d.pid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        s.settimeout(30)
        s.connect(str(d.socket))
        s.sendall(b"GET /v1/events?after=0&follow=1 HTTP/1.1\r\nHost: mlxceld\r\n\r\n")
        time.sleep(0.5)  # the stream has sent what there was and waits for news
        before = daemon.memory_info().rss
        with contextlib.closing(sqlite3.connect(d.state_dir / "state.db", timeout=30)) as db:
            first = db.execute("select max(id) from events").fetchone()[0] + 1
            with db:
                db.executemany(
                    "insert into events (ts, kind, subject, message, data) "
                    "values (?, 'test.bulk', 'test', ?, '{}')",
                    [(time.time(), f"{i:08d}" + "x" * (EVENT_BYTES - 8))
                     for i in range(STALLED_EVENTS)])
        assert d.ctl("restart", "alpha").returncode == 0  # news: the stream reads on
        time.sleep(2.0)  # it writes until the socket's buffers are full, then waits
        grown = daemon.memory_info().rss - before
        print(f"daemon RSS grew {grown / 2**20:.1f} MiB while a follower read nothing of "
              f"{STALLED_EVENTS * EVENT_BYTES / 2**20:.0f} MiB of events")
        assert grown < 8 * 2**20
        assert d.ctl("status").returncode == 0  # the daemon answers meanwhile
        ids: list[int] = []
        pending = b""
        body_at = None
        while len(ids) < STALLED_EVENTS:
            data = s.recv(1 << 16)
            assert data, f"the stream ended after {len(ids)} bulk events"
            pending += data
            if body_at is None:
                head, sep, pending = pending.partition(b"\r\n\r\n")
                if not sep:
                    pending = head
                    continue
                body_at = 0
            *lines, pending = pending.split(b"\n")
            for line in lines:  # chunked encoding: size lines, then our JSON lines
                if line.startswith(b"{"):
                    event = json.loads(line)
                    if event["kind"] == "test.bulk":
                        ids.append(event["id"])
    assert ids == list(range(first, first + STALLED_EVENTS))


STALL_S = 2.0  # the daemon's follower stall bound in this test (30 s by default)
STALL_EVENTS = 2_000  # 4 MiB of lines: far above the socket's and the transport's buffers
STALL_LINE = "closed a connection that took nothing of its response for 2 s"


def test_a_stopped_follower_is_disconnected_and_says_how_to_go_on(daemons: Daemons) -> None:
    """``mlxctl events -f`` stopped (SIGSTOP: a suspended pipe) while events pour in: once
    the buffers are full the daemon waits ``FOLLOWER_STALL_S`` for it to take anything,
    then drops its connection (one log line), so that stopped followers hold none of the
    control socket's connections; the daemon answers meanwhile. Resumed, the follower
    prints what had reached it, in order, then says the stream ended and what to do."""
    d = daemons.make(ONE_ECHO).start(env={"MLXCELD_TEST_FOLLOWER_STALL_S": str(STALL_S)})
    daemons.pids.add(d.wait_worker("alpha", state="running")["pid"])
    f = Follower(d, "-n", "1")
    try:
        f.wait("the last past event", lambda e: True)
        os.kill(f.proc.pid, signal.SIGSTOP)
        try:
            with contextlib.closing(sqlite3.connect(d.state_dir / "state.db",
                                                    timeout=30)) as db, db:
                db.executemany(
                    "insert into events (ts, kind, subject, message, data) "
                    "values (?, 'test.bulk', 'test', ?, '{}')",
                    [(time.time(), "x" * EVENT_BYTES) for _ in range(STALL_EVENTS)])
            woke = time.monotonic()
            assert d.ctl("restart", "alpha").returncode == 0  # news: the stream writes
            wait_for(lambda: STALL_LINE in d.stderr(), 30, "the daemon to drop the follower",
                     every=0.05)
            took = time.monotonic() - woke
            assert d.ctl("status").returncode == 0
        finally:
            os.kill(f.proc.pid, signal.SIGCONT)
        code = f.proc.wait(timeout=30)
        f._reader.join(10)
        assert f.proc.stderr is not None and f.proc.stdout is not None
        err = f.proc.stderr.read()
    finally:
        f.kill()
        for pipe in (f.proc.stdout, f.proc.stderr):
            if pipe is not None:
                pipe.close()
    print(f"\na stopped follower dropped {took:.2f} s after the events began (bound "
          f"{STALL_S:g} s once the buffers are full)")
    assert STALL_S <= took < STALL_S + 10, took  # the buffers fill in well under a second
    assert code == 1, err
    assert "Traceback" not in err
    lines = [line for _, line in f.lines]
    split = next(i for i, line in enumerate(lines) if not line.startswith('{"schema": '
                                                                          '"mlxctl.event/1"'))
    events = [json.loads(line) for line in lines[:split]]
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert 0 < sum(e["kind"] == "test.bulk" for e in events) < STALL_EVENTS  # cut short
    error = json.loads("".join(lines[split:]))
    assert error["schema"] == "mlxctl.error/1", error
    message, hint = error["error"]["message"], error["error"]["hint"]
    assert message.startswith(f"the event stream ended after event {ids[-1]}: "), message
    assert "reads nothing for 30 s" in hint and "mlxctl events -f again" in hint, hint
