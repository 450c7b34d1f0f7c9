"""Real daemons as subprocesses, each in its own short temp dir, ended by pid afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

from mlxceld.control.clients.typed import ControlClient
from mlxceld.errors import ControlError, DaemonNotRunning

from helpers.waiting import wait_for

T = TypeVar("T")

STARTUP_TIMEOUT_S = 60.0  # a daemon's socket answering: ~1 s alone, more beside parallel tests
STOP_S = 20.0  # a daemon's exit after SIGTERM at the end of a test, before SIGKILL
READY_S = 120.0  # a router or stage worker loading its model, on a busy CPU
# Every daemon's compute units, unless a test says otherwise (``env``): plans over
# daemons on one loaded host split by memory, whatever the load (mlxceld/failpoints.py).
SPEED_ENV = {"MLXCELD_TEST_COMPUTE_UNITS": "1"}

FAST_POLICY = """
[supervisor]
backoff_initial_s = 0.2
backoff_max_s = 1.0
stable_after_s = 30.0
stop_timeout_s = 3.0
health_interval_s = 0.5
"""
# Two echo workers under FAST_POLICY: a daemon with workers and no model.
TWO_ECHOS = FAST_POLICY + """
[workers.alpha]
role = "echo"
options = { interval_s = 0.2 }

[workers.beta]
role = "echo"
options = { interval_s = 0.2 }
"""


def alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class DaemonProc:
    root: Path
    config: Path
    proc: subprocess.Popen[bytes] | None = None
    stderr_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.stderr_path = self.root / "daemon.stderr"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def socket(self) -> Path:
        return self.root / "run" / "ctl.sock"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, *extra: str, wait: bool = True, env: dict[str, str] | None = None,
              prefix: tuple[str, ...] = ()) -> DaemonProc:
        """Start the daemon with ``extra`` flags; ``env`` is added to this process's
        environment (fail points, for one start only); ``prefix`` runs it under a command
        that execs it. Its compute units are ``SPEED_ENV``'s unless ``env`` says."""
        with self.stderr_path.open("ab") as err:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "mlxceld", "--config", str(self.config),
                 "--state-dir", str(self.state_dir), "--socket", str(self.socket),
                 *(() if "--agent-addr" in extra else ("--agent-addr", "127.0.0.1:0")),
                 *extra],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                env={**os.environ, **SPEED_ENV, **(env or {})},
            )
        if wait:
            wait_for(self._ready, STARTUP_TIMEOUT_S, f"daemon on {self.socket}")
        return self

    def start_service(self, *, wait: bool = True, env: dict[str, str] | None = None,
                      prefix: tuple[str, ...] = ()) -> DaemonProc:
        """Start the daemon as launchd, systemd or brew do: ``mlxceld --config FILE`` and
        nothing else (the file holds the state dir and socket, see tests/helpers/deploy.py);
        ``env`` is added to the environment (what a unit's Environment= would set);
        ``prefix`` runs it under another command that execs it (``ip netns exec NS``)."""
        with self.stderr_path.open("ab") as err:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "mlxceld", "--config", str(self.config)],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                env={**os.environ, **SPEED_ENV, **(env or {})})
        if wait:
            wait_for(self._ready, STARTUP_TIMEOUT_S, f"daemon on {self.socket}")
        return self

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, as a service manager stops a daemon; its exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"daemon exited with {self.proc.returncode}:\n{self.stderr()}")
        try:
            self.api(lambda c: c.version())
        except DaemonNotRunning:
            return False
        return True

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def ctl(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mlxctl", "--socket", str(self.socket), *args],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "NO_COLOR": "1", **(env or {})},
        )

    def api(self, job: Callable[[ControlClient], Awaitable[T]]) -> T:
        """Call the control API in-process (the typed client mlxctl uses)."""

        async def go() -> T:
            async with ControlClient(self.socket) as client:
                return await job(client)

        try:
            return asyncio.run(go())
        except DaemonNotRunning as exc:  # say how it ended, for a CI log to show
            code = self.proc.poll() if self.proc is not None else None
            raise DaemonNotRunning(f"{exc.message}; its process: "
                                   + ("not started" if self.proc is None else
                                      "still running" if code is None else f"exit {code}")
                                   + "; the end of its log:\n" + self.stderr()[-4000:],
                                   hint=exc.hint) from exc

    def status(self) -> dict[str, Any]:
        return self.api(lambda c: c.status())

    def worker(self, name: str) -> dict[str, Any]:
        for w in self.status()["workers"]:
            if w["name"] == name:
                return dict(w)
        raise AssertionError(f"no worker {name} in status")

    def events(self, last: int = 200) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = self.api(lambda c: c.events(-last, last))["events"]
        return events

    def wait_worker(self, name: str, timeout: float = 20.0,
                    **expected: Any) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            w = next((w for w in self.status()["workers"] if w["name"] == name), None)
            return w if w and all(w.get(k) == v for k, v in expected.items()) else None

        result: dict[str, Any] = wait_for(check, timeout, f"worker {name} with {expected}",
                                          every=0.1)
        return result

    def recorded_pids(self) -> set[int]:
        """Every worker pid the state database knows (read-only, for cleanup)."""
        db = self.state_dir / "state.db"
        if not db.exists():
            return set()
        query = "select pid from workers where pid is not null"
        with contextlib.suppress(sqlite3.Error), contextlib.closing(
            sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        ) as conn:
            return {r[0] for r in conn.execute(query)}
        return set()


class Daemons:
    """Starts daemons for a test and ends every process they made, by pid."""

    def __init__(self) -> None:
        self.started: list[DaemonProc] = []
        self.pids: set[int] = set()

    def make(self, config: str = "", name: str = "d") -> DaemonProc:
        root = Path(tempfile.mkdtemp(prefix=f"mx{name}", dir="/tmp"))
        (root / "run").mkdir(mode=0o700)
        cfg = root / "mlxceld.toml"
        cfg.write_text(textwrap.dedent(config))
        d = DaemonProc(root, cfg)
        self.started.append(d)
        return d

    def note(self, d: DaemonProc) -> None:
        """Every worker pid of ``d``: its database's, its status's, and (should its socket
        not answer) every process below the daemon's."""
        self.pids |= d.recorded_pids()
        try:
            workers = d.status()["workers"]
        except (ControlError, OSError):  # a daemon that cannot answer: its processes still end
            workers = []
        self.pids |= {w["pid"] for w in workers if w["pid"]}
        if d.proc is not None:
            with contextlib.suppress(psutil.Error):
                self.pids |= {c.pid for c in psutil.Process(d.proc.pid).children(True)}

    def end(self) -> None:
        """``cleanup`` after noting the workers of every daemon still running (asked over
        its socket): a module's cluster that outlives the ``daemons`` fixture ends so."""
        try:
            for d in self.started:
                if d.proc is not None and d.proc.poll() is None:
                    self.note(d)
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """SIGTERM to every daemon still running at once (a cluster stops in the time of its
        slowest daemon, not the sum), 20 s each to exit before SIGKILL; then every process
        they made, by pid."""
        stopping: list[subprocess.Popen[bytes]] = []
        for d in self.started:
            self.pids |= d.recorded_pids()
            if d.proc is not None and d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                stopping.append(d.proc)
        deadline = time.monotonic() + STOP_S
        for proc in stopping:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.pids - {None}:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        for d in self.started:
            shutil.rmtree(d.root, ignore_errors=True)
