"""sd_notify: the notifier against a real datagram socket, and a real daemon reporting to one."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from mlxceld.control.clients.typed import ControlClient
from mlxceld.sdnotify import Notifier, notify_address, status_line, watchdog_interval

from helpers.daemons import FAST_POLICY, Daemons, alive

ROOT = Path(__file__).resolve().parents[2]

ONE_ECHO = FAST_POLICY + """
[workers.tick]
role = "echo"
options = { interval_s = 0.1 }
"""


class Listener:
    """A bound AF_UNIX datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.got: list[dict[str, str]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
        self.got.append(fields)
        return fields

    def until(self, key: str, timeout: float, value: str | None = None) -> dict[str, str]:
        """Read datagrams until one carries ``key`` (with ``value``); fail at the deadline."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.receive(left)
            if msg is not None and key in msg and (value is None or msg[key] == value):
                return msg
        pytest.fail(f"no {key}{'=' + value if value else ''} within {timeout} s; "
                    f"got {self.got!r}")

    def seen(self, key: str, value: str, timeout: float) -> None:
        """Like ``until``, but a datagram already read counts too."""
        deadline = time.monotonic() + timeout
        while not any(m.get(key) == value for m in self.got):
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {key}={value} within {timeout} s; got {self.got!r}")
            self.receive(min(left, 0.5))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[tuple[Listener, str]]:
    root = tempfile.mkdtemp(prefix="mxnot", dir="/tmp")  # short: sun_path holds 108 bytes
    path = os.path.join(root, "notify")
    sock = Listener(path)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(root, ignore_errors=True)


def test_address_forms() -> None:
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@abstract/name") == "\0abstract/name"
    assert notify_address("@") is None
    assert notify_address("relative/path") is None
    assert notify_address("vsock:2:1234") is None


def test_watchdog_interval_is_half_and_only_for_our_pid() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}, 42) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "42"}, 42) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "7"}, 42) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}, 42) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}, 42) is None
    assert watchdog_interval({}, 42) is None


def test_without_notify_socket_nothing_is_sent() -> None:
    n = Notifier.from_environment({"WATCHDOG_USEC": "1000000"}, pid=1)
    assert not n.enabled and n.watchdog_s is None
    assert n.send(READY="1") is False
    asyncio.run(asyncio.wait_for(n.run(lambda: "x"), 1.0))  # returns at once


def test_ready_status_and_stopping_reach_a_path_socket(listener: tuple[Listener, str]) -> None:
    sock, path = listener
    n = Notifier.from_environment({"NOTIFY_SOCKET": path}, pid=1)
    assert n.ready("serving tiny; workers: router starting")
    assert sock.receive(2.0) == {"READY": "1",
                                 "STATUS": "serving tiny; workers: router starting"}
    assert n.reloading()
    msg = sock.receive(2.0)
    assert msg is not None and msg["RELOADING"] == "1"
    assert 0 < int(msg["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.stopping(25.0, 2)
    msg = sock.receive(2.0)
    assert msg is not None and msg["STOPPING"] == "1"
    assert msg["EXTEND_TIMEOUT_USEC"] == "25000000"
    n.close()


def test_a_newline_in_a_value_cannot_forge_a_second_field(
        listener: tuple[Listener, str]) -> None:
    sock, path = listener
    n = Notifier(notify_address(path))
    assert n.send(STATUS="model x\nREADY=1")
    assert sock.receive(2.0) == {"STATUS": "model x READY=1"}
    n.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="the abstract socket namespace exists on Linux only")
def test_abstract_namespace_address() -> None:
    name = f"mlxceld-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = Listener("\0" + name)
    try:
        n = Notifier.from_environment({"NOTIFY_SOCKET": "@" + name}, pid=1)
        assert n.ready("idle")
        assert sock.receive(2.0) == {"READY": "1", "STATUS": "idle"}
        n.close()
    finally:
        sock.close()


def test_a_missing_socket_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier.from_environment({"NOTIFY_SOCKET": "/nonexistent/mlxceld-notify"}, pid=1)
    assert n.enabled
    assert n.send(READY="1") is False
    assert "cannot notify the service manager at /nonexistent/mlxceld-notify" in caplog.text
    n.close()


def test_run_pings_the_watchdog_and_sends_status_on_change(
        listener: tuple[Listener, str]) -> None:
    sock, path = listener
    n = Notifier(notify_address(path), watchdog_s=0.05)
    lines = iter(["a", "a", "a", "b"])

    def status() -> str:
        return next(lines, "b")

    got = run_for(n, status, 0.4, sock)
    assert len(got) >= 5, got
    assert all(m["WATCHDOG"] == "1" for m in got)
    assert [m["STATUS"] for m in got if "STATUS" in m] == ["a", "b"]


def run_for(n: Notifier, status: Callable[[], str], seconds: float,
            sock: Listener) -> list[dict[str, str]]:
    """Run the notifier's loop for ``seconds``, close it, and return what it sent."""
    async def go() -> None:
        task = asyncio.create_task(n.run(status))
        await asyncio.sleep(seconds)
        n.close()
        await asyncio.wait_for(task, 2.0)

    asyncio.run(go())
    got = []
    while (msg := sock.receive(0.2)) is not None:
        got.append(msg)
    return got


def test_a_failing_status_keeps_the_watchdog_going(listener: tuple[Listener, str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    sock, path = listener
    n = Notifier(notify_address(path), watchdog_s=0.05)

    def status() -> str:
        raise KeyError("serving")

    got = run_for(n, status, 0.2, sock)
    assert got and all(m == {"WATCHDOG": "1"} for m in got)
    assert "no STATUS= for the service manager: KeyError" in caplog.text


def test_status_line_names_the_model_the_workers_and_problems() -> None:
    status = {"daemon": {"state": "running"},
              "serving": {"model_name": "tiny", "url": "http://127.0.0.1:8080/v1"},
              "workers": [{"name": "router", "state": "starting"}],
              "problems": [{"subject": "router"}]}
    assert status_line(status) == ("serving tiny at http://127.0.0.1:8080/v1; workers: "
                                   "router starting; 1 problem(s), see mlxctl status")
    idle = {"daemon": {"state": "running"}, "serving": None, "workers": [], "problems": []}
    assert status_line(idle) == "idle (no model); workers: none"
    loading = {"done": 1 << 29, "total": 1 << 31, "since": time.time() - 2}
    peer = {"daemon": {"state": "running"}, "serving": None, "problems": [],
            "workers": [{"name": "stage", "state": "starting", "loading": loading}]}
    assert status_line(peer) == "idle (no model); workers: stage loading 25% of 2.0 GiB, 2 s"


# -- a real daemon -----------------------------------------------------------------------


def test_daemon_reports_ready_watchdog_reload_and_stop(
        daemons: Daemons, listener: tuple[Listener, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    d = daemons.make(ONE_ECHO).start(wait=False)
    ready = sock.until("READY", 20.0)
    # READY only once the control socket answers and the configured worker is supervised.
    assert d.socket.exists()
    assert [w["name"] for w in d.status()["workers"]] == ["tick"]
    assert "workers: tick" in ready["STATUS"]
    w = d.wait_worker("tick", state="running")
    daemons.pids.add(w["pid"])
    # The service manager's variables stay with the daemon: workers may not notify.
    env = psutil.Process(w["pid"]).environ()
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(env)
    assert psutil.Process(d.pid).environ()["NOTIFY_SOCKET"] == path
    pings = [sock.until("WATCHDOG", 2.0) for _ in range(3)]  # every 0.2 s
    assert all(p["WATCHDOG"] == "1" for p in pings)
    sock.seen("STATUS", "idle (no model); workers: tick running", 10.0)

    os.kill(d.pid, signal.SIGHUP)
    sock.until("RELOADING", 10.0, "1")
    sock.until("READY", 10.0, "1")

    os.kill(d.pid, signal.SIGTERM)
    stopping = sock.until("STOPPING", 10.0, "1")
    # The drain deadline: the worker's 3 s stop timeout plus the daemon's 5 s of slack.
    assert stopping["EXTEND_TIMEOUT_USEC"] == "8000000"
    assert d.proc is not None and d.proc.wait(timeout=20) == 0


def test_daemon_is_ready_only_after_readopting_survivors(
        daemons: Daemons, listener: tuple[Listener, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = listener
    d = daemons.make(ONE_ECHO).start()
    pid = d.wait_worker("tick", state="running")["pid"]
    daemons.note(d)
    os.kill(d.pid, signal.SIGKILL)
    assert d.proc is not None
    d.proc.wait(timeout=10)
    assert alive(pid), "a worker must survive its daemon"
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    d.start(wait=False)
    sock.until("READY", 20.0)
    w = d.worker("tick")
    assert (w["pid"], w["state"]) == (pid, "running")
    assert "worker.adopted" in {e["kind"] for e in d.events()}


def test_daemon_started_like_the_systemd_unit(listener: tuple[Listener, str]) -> None:
    """No flags, the unit's directories in the environment, the example config, UMask 0077:
    the daemon finds its file, state and socket where the unit puts them, and says READY."""
    sock, path = listener
    root = Path(tempfile.mkdtemp(prefix="mxunit", dir="/tmp"))
    dirs = {name: root / name for name in ("state", "run", "etc")}
    for d in dirs.values():
        d.mkdir(mode=0o700)
    shutil.copy(ROOT / "contrib" / "mlxceld.toml", dirs["etc"] / "mlxceld.toml")
    env = {**os.environ, "STATE_DIRECTORY": str(dirs["state"]),
           "RUNTIME_DIRECTORY": str(dirs["run"]), "CONFIGURATION_DIRECTORY": str(dirs["etc"]),
           "NOTIFY_SOCKET": path}
    with (root / "stderr").open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mlxceld"], env=env, umask=0o077,
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    try:
        ready = sock.until("READY", 20.0)
        assert ready["STATUS"] == "idle (no model); workers: none"
        control = dirs["run"] / "mlxceld.sock"
        assert stat.S_IMODE(control.stat().st_mode) == 0o600

        async def status() -> dict[str, Any]:
            async with ControlClient(control) as client:
                return await client.status()

        daemon = asyncio.run(status())["daemon"]
        assert daemon["config_file"] == str(dirs["etc"] / "mlxceld.toml")
        assert daemon["state_dir"] == str(dirs["state"])
        assert (dirs["state"] / "state.db").exists()
        proc.send_signal(signal.SIGTERM)
        sock.until("STOPPING", 10.0, "1")
        assert proc.wait(timeout=20) == 0, (root / "stderr").read_text()
        assert not control.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)
