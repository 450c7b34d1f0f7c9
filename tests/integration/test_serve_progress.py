"""`mlxctl serve` shows the router's load as it happens: a real daemon, the tiny fixture, each
layer's read slowed by ``MLXCELD_TEST_ROUTER_LAYER_S`` so that the load lasts seconds.

Off a terminal: a line per step and per tenth of the load, then the ready line; meanwhile
`mlxctl status` says ``router: loading N% of X MiB, T s`` and the daemon's worker row carries
the ``loading`` systemd's STATUS line is made of. On a pseudo-terminal a rich bar is drawn,
and a daemon killed in the middle ends the command (exit 3) instead of leaving it waiting."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.ports import free_port

# The tiny fixture has 2 layers, so three pauses (after 0%, ~26%, ~53%): 3 s in all, past
# the supervisor's ask of a starting worker's load every 2 s (LOADS_EVERY_S).
LAYER_S = 1.0
GONE_S = 20.0  # a command whose daemon died must end within this (a poll's 10 s deadline)


def slow_daemon(daemons: Daemons, layer_s: float) -> tuple[DaemonProc, int]:
    port = free_port()
    d = daemons.make(FAST_POLICY + f"\n[serve]\nport = {port}\n").start(
        env={"MLXCELD_TEST_ROUTER_LAYER_S": str(layer_s)})
    return d, port


def mlxctl(d: DaemonProc, *args: str, **popen: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "mlxctl", "--socket", str(d.socket), *args],
                            stdin=subprocess.DEVNULL, **popen)  # type: ignore[call-overload]


def test_serve_off_a_terminal_says_each_step_and_ends_ready(daemons: Daemons,
                                                            fixture_dir: Path) -> None:
    d, port = slow_daemon(daemons, LAYER_S)
    model = fixture_dir / "llama"
    serve = mlxctl(d, "serve", str(model), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                   env={**os.environ, "NO_COLOR": "1"})
    status_lines: set[str] = set()
    rows: list[dict[str, object]] = []
    try:
        deadline = time.monotonic() + READY_S
        while serve.poll() is None and time.monotonic() < deadline:
            workers = d.status()["workers"]
            rows += [w["loading"] for w in workers if w.get("loading")]
            if not status_lines and any((w.get("stats") or {}).get("loading")
                                        for w in workers):  # then ask as a user does
                status_lines = {line for line in d.ctl("status").stdout.splitlines()
                                if line.startswith("router: loading ")}
            time.sleep(0.2)
        out, err = serve.communicate(timeout=READY_S)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    daemons.note(d)
    assert serve.returncode == 0, err
    lines = out.decode().splitlines()
    assert lines[0] == f"serve llama from {model.resolve()}: starting the router", lines
    assert re.fullmatch(r"router starting \(pid \d+\)", lines[1]), lines
    loads = [int(m.group(1)) for line in lines
             if (m := re.fullmatch(r"router: loading (\d+)% of [\d.]+ [KM]iB, \d+ s", line))]
    assert loads == sorted(loads) and len(loads) >= 2, lines
    assert [pct for pct in loads if 0 < pct < 100], lines  # the load seen going on
    assert lines[-1] == f"serving llama at http://127.0.0.1:{port}/v1 (router running)"
    # Meanwhile `mlxctl status` and the rows systemd's STATUS line is made of said so.
    assert status_lines, "mlxctl status never showed the router's load"
    assert all(re.fullmatch(r"router: loading \d+% of [\d.]+ [KM]iB, \d+ s", line)
               for line in status_lines), status_lines
    assert rows and all(r["total"] == rows[0]["total"] for r in rows), rows


def test_serve_on_a_terminal_draws_a_bar_and_ends_when_the_daemon_dies(
        daemons: Daemons, fixture_dir: Path) -> None:
    d, _ = slow_daemon(daemons, 0.5)  # killed as soon as the bar shows
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "100", "PYTHONIOENCODING": "utf-8"}
    env.pop("NO_COLOR", None)
    serve = mlxctl(d, "serve", str(fixture_dir / "qwen3"), stdout=slave, stderr=slave, env=env)
    os.close(slave)
    seen = b""

    def read_until(done: re.Pattern[bytes] | None, timeout: float) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (done and done.search(seen)):
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the command ended and closed the terminal
                    return
                if not chunk:
                    return
                seen += chunk

    try:
        # rich's bar (its heavy line) beside the percentage, labelled with the router
        read_until(re.compile(rb"router.*\xe2\x94\x81.*\d+%"), READY_S)
        text = seen.decode(errors="replace")
        assert re.search(r"router.*━.*\d+%", text), text
        assert "router starting (pid" in text, text
        daemons.note(d)
        assert d.proc is not None
        d.proc.kill()  # SIGKILL: no answer ever again; its router lives on (ended by pid)
        d.proc.wait()
        begun = time.monotonic()
        assert serve.wait(GONE_S) == 3
        assert time.monotonic() - begun < GONE_S
        read_until(None, 2.0)
        text = seen.decode(errors="replace")
        assert "mlxceld is not running" in text, text
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        with contextlib.suppress(OSError):
            os.close(master)
