"""The worker runtime for real: an echo worker subprocess, driven over its control channel."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxceld.errors import ChannelError
from mlxceld.roles.options import EchoOptions
from mlxceld.supervisor import channel
from mlxceld.supervisor.exits import classify, read_exit_record
from mlxceld.supervisor.keys import api_key_tag, reported_api_key
from mlxceld.supervisor.logfiles import tail
from mlxceld.supervisor.ops import ApiKeyUpdate
from mlxceld.supervisor.process import WorkerSpec, child_environment
from mlxceld.types import JSON

from helpers.workerops import Op

READY_TIMEOUT_S = 15.0
EXIT_TIMEOUT_S = 5.0


class Worker:
    """One ``python -m mlxceld.workers`` process, fed its bootstrap on stdin like spawn() does."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        for d in (spec.control_socket.parent, spec.log_path.parent):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        with spec.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlxceld.workers", "--role", spec.role,
                 "--name", spec.name],
                stdin=subprocess.PIPE, stdout=log, stderr=log, cwd=spec.state_dir,
                env=child_environment(), start_new_session=True,
            )
        assert self.proc.stdin is not None
        with self.proc.stdin:
            self.proc.stdin.write(json.dumps(spec.bootstrap()).encode())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, op: str, timeout_s: float = 2.0) -> JSON:
        return asyncio.run(channel.call(self.spec.control_socket, Op(op), timeout_s=timeout_s))

    def log(self) -> str:
        return self.spec.log_path.read_text(errors="replace")

    def wait_ready(self) -> JSON:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"worker exited {self.proc.returncode} before ready:\n{self.log()}")
            with contextlib.suppress(ChannelError):
                reply = self.call("health", timeout_s=0.5)
                if reply.get("state") == "ready":
                    return reply
            time.sleep(0.02)
        pytest.fail(f"worker not ready within {READY_TIMEOUT_S} s:\n{self.log()}")

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker still running after {EXIT_TIMEOUT_S} s:\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def start(state_dir: Path) -> Iterator[Any]:
    started: list[Worker] = []

    def make(name: str = "t1", **options: Any) -> Worker:
        worker = Worker(WorkerSpec(name, state_dir, EchoOptions(**options)))
        started.append(worker)
        return worker

    try:
        yield make
    finally:
        for worker in started:
            worker.kill()


def test_health_stats_unknown_op_and_stop(start: Any) -> None:
    worker = start(interval_s=0.02)
    health = worker.wait_ready()
    assert health["ok"] is True
    assert (health["name"], health["role"], health["pid"]) == ("t1", "echo", worker.pid)
    assert health["state"] == "ready"
    assert health["started_at"] <= time.time()

    deadline = time.monotonic() + 5.0
    while (ticks := worker.call("stats")["stats"]["ticks"]) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert isinstance(ticks, int) and ticks >= 1

    with pytest.raises(ChannelError, match="unknown op 'reboot'"):
        worker.call("reboot")

    assert worker.call("stop") == {"ok": True}
    assert worker.wait_exit() == 0
    record = json.loads(worker.spec.exit_record.read_text())
    assert record == {"pid": worker.pid, "returncode": 0, "kind": "clean",
                      "summary": "exited cleanly"}
    cause = read_exit_record(worker.spec.exit_record, worker.pid)
    assert cause is not None and cause.kind == "clean"
    assert "echo worker t1 stopping after" in worker.log()
    assert not worker.spec.control_socket.exists() or _refuses(worker.spec.control_socket)


def test_the_api_key_op_swaps_the_key_and_health_shows_only_its_tag(state_dir: Path) -> None:
    # A worker given a key on its bootstrap pipe reports a salted tag of it; the api_key
    # op replaces it (the supervisor's push after a reload), and the tag follows.
    spec = WorkerSpec("keyed", state_dir, EchoOptions(), api_key="sk-first-1234")
    worker = Worker(spec)
    try:
        held = reported_api_key(worker.wait_ready())
        assert held is not None and held[1] == api_key_tag("sk-first-1234", held[0])
        reply = asyncio.run(channel.call(spec.control_socket, ApiKeyUpdate("sk-second-5678")))
        assert reported_api_key(reply) == (held[0], api_key_tag("sk-second-5678", held[0]))
        with pytest.raises(ChannelError, match="api_key"):
            asyncio.run(channel.call(spec.control_socket, ApiKeyUpdate("short")))
        health = worker.call("health")
        assert reported_api_key(health) == (held[0], api_key_tag("sk-second-5678", held[0]))
        assert "sk-first" not in worker.log() and "sk-second" not in worker.log()
        assert "API key replaced" in worker.log()
    finally:
        worker.kill()


def _refuses(path: Path) -> bool:
    try:
        asyncio.run(channel.call(path, Op("health"), timeout_s=0.5))
    except ChannelError:
        return True
    return False


def test_crash_leaves_an_exception_record_and_a_traceback(start: Any) -> None:
    worker = start(crash_after_s=0.1)
    assert worker.wait_exit() == 1
    cause = read_exit_record(worker.spec.exit_record, worker.pid)
    assert cause is not None
    assert (cause.kind, cause.returncode) == ("exception", 1)
    assert "RuntimeError" in cause.summary
    assert "crashed on purpose" in cause.summary
    log = worker.log()
    assert "Traceback (most recent call last):" in log
    assert "RuntimeError: echo worker t1 crashed on purpose" in log
    # The daemon's own reading of the log agrees with the worker's record.
    assert classify(1, tail(worker.spec.log_path, 50)[0], oom_kills_grew=None).summary \
        == cause.summary


def test_sigterm_is_a_clean_exit(start: Any) -> None:
    worker = start()
    worker.wait_ready()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
    cause = read_exit_record(worker.spec.exit_record, worker.pid)
    assert cause is not None and cause.kind == "clean"


def test_exit_code_option_is_recorded_as_a_status(start: Any) -> None:
    worker = start(exit_after_s=0.05, exit_code=3)
    assert worker.wait_exit() == 3
    cause = read_exit_record(worker.spec.exit_record, worker.pid)
    assert cause is not None
    assert (cause.kind, cause.summary, cause.returncode) == ("status", "exited with status 3", 3)


def test_stale_exit_record_is_removed_at_start(start: Any, state_dir: Path) -> None:
    stale = state_dir / "workers" / "t1.exit"
    stale.parent.mkdir(mode=0o700)
    stale.write_text(json.dumps({"pid": 1, "returncode": 0, "kind": "clean", "summary": "old"}))
    worker = start(ready_after_s=60)
    assert worker.spec.exit_record == stale
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(ChannelError):
            if worker.call("health", timeout_s=0.5)["state"] == "starting":
                break
        time.sleep(0.02)
    else:
        pytest.fail(f"worker never answered:\n{worker.log()}")
    assert not worker.spec.exit_record.exists()
    worker.call("stop")  # also ends the ready_after_s wait
    assert worker.wait_exit() == 0


# -- channel.call failures -------------------------------------------------------------------------


def test_call_where_nothing_listens_fails_fast(state_dir: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ChannelError, match="failed on 'health'") as info:
        asyncio.run(channel.call(state_dir / "nobody.sock", Op("health"), timeout_s=5.0))
    assert time.monotonic() - start < 1.0
    assert info.value.hint


def test_call_to_a_closed_socket_file_fails_fast(state_dir: Path) -> None:
    path = state_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))  # a socket file left behind by a dead worker
    start = time.monotonic()
    with pytest.raises(ChannelError, match="failed on 'health'"):
        asyncio.run(channel.call(path, Op("health"), timeout_s=5.0))
    assert time.monotonic() - start < 1.0


def test_call_to_a_silent_listener_times_out(state_dir: Path) -> None:
    path = state_dir / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        sock.listen(1)
        start = time.monotonic()
        with pytest.raises(ChannelError, match=r"did not answer 'health' within 0\.3 s"):
            asyncio.run(channel.call(path, Op("health"), timeout_s=0.3))
        elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 2.0


def test_call_to_a_listener_that_hangs_up_or_answers_junk(state_dir: Path) -> None:
    path = state_dir / "junk.sock"
    replies = [b"", b"not json\n", b'{"ok": false, "error": "no"}\n', b"[1]\n"]

    async def scenario() -> list[str]:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readline()
            writer.write(replies.pop(0))
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_unix_server(answer, path=str(path))
        errors = []
        async with server:
            for _ in range(4):
                with pytest.raises(ChannelError) as info:
                    await channel.call(path, Op("health"), timeout_s=2.0)
                errors.append(str(info.value))
        return errors

    errors = asyncio.run(scenario())
    assert "failed on 'health'" in errors[0]  # EOF: an empty line is not JSON
    assert "failed on 'health'" in errors[1]
    assert "refused 'health'" in errors[2]
    assert "refused 'health'" in errors[3]
