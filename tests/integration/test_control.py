"""The control surface of a real daemon: file modes, refusals, exit codes, JSON shapes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons
from helpers.waiting import wait_for

ONE_ECHO = FAST_POLICY + """
[workers.alpha]
role = "echo"
options = { interval_s = 0.1 }
"""


@pytest.fixture(scope="module")
def echo() -> Iterator[DaemonProc]:
    """One daemon with worker alpha for the tests below that read it or restart alpha
    (which comes back by itself); each waits for alpha running. The two restarts leave 14
    events in all: ``daemon.started`` stays among the last 20 that ``mlxctl events`` shows.
    The test that starts a daemon with a secret in its environment keeps its own."""
    owner = Daemons()
    try:
        yield owner.make(ONE_ECHO).start()
    finally:
        owner.end()


@pytest.fixture(scope="module")
def bare() -> Iterator[DaemonProc]:
    """One daemon without workers for the tests below that only ask it (the two that
    loosen its files' modes put them back)."""
    owner = Daemons()
    try:
        yield owner.make().start()
    finally:
        owner.end()


@contextlib.contextmanager
def loosened(d: DaemonProc) -> Iterator[None]:
    """Its socket, the socket's directory and its root open to others, as the test asks;
    their modes back as they were afterwards, so that the shared daemon is left as found."""
    paths = (d.root, d.socket.parent, d.socket)
    before = [mode(p) for p in paths]
    try:
        for p, m in zip(paths, (0o711, 0o711, 0o666), strict=True):
            os.chmod(p, m)
        yield
    finally:
        for p, m in zip(paths, before, strict=True):
            os.chmod(p, m)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def raw_get(sock: Path, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.AsyncHTTPTransport(uds=str(sock))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(go())


def test_socket_and_state_files_are_private(echo: DaemonProc) -> None:
    d = echo
    d.wait_worker("alpha", state="running")
    assert stat.S_ISSOCK(d.socket.stat().st_mode)
    assert mode(d.socket) == 0o600
    assert mode(d.socket.parent) == 0o700
    assert mode(d.state_dir) == 0o700
    for name in ("state.db", "mlxceld.lock", "logs/alpha.log", "workers/alpha.sock"):
        assert mode(d.state_dir / name) == 0o600, name
    assert mode(d.state_dir / "logs") == 0o700


def test_second_daemon_on_the_same_state_dir_is_refused(echo: DaemonProc) -> None:
    d = echo
    other = subprocess.run(
        [sys.executable, "-m", "mlxceld", "--config", str(d.config), "--state-dir",
         str(d.state_dir), "--socket", str(d.root / "run" / "other.sock")],
        capture_output=True, text=True, timeout=30,
    )
    assert other.returncode == 1
    assert f"another mlxceld (pid {d.pid}) is already running" in other.stderr
    assert d.status()["daemon"]["pid"] == d.pid  # the first one is untouched


def test_mlxctl_without_a_daemon_exits_3_with_a_hint(daemons: Daemons) -> None:
    d = daemons.make()
    out = d.ctl("status")
    assert out.returncode == 3
    assert "mlxceld is not running" in out.stderr and "hint: start it with `mlxceld`" in out.stderr
    as_json = json.loads(d.ctl("workers", "--json").stdout)
    assert as_json["schema"] == "mlxctl.error/1" and as_json["error"]["code"] == "not_running"


def test_browser_headers_are_refused(bare: DaemonProc) -> None:
    d = bare
    for header in ({"Origin": "http://evil.example"}, {"Referer": "http://evil.example/x"}):
        r = raw_get(d.socket, "/v1/status", header)
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "cross_origin_refused"
    assert raw_get(d.socket, "/v1/status").status_code == 200


def test_every_response_carries_the_version_and_errors_have_one_shape(bare: DaemonProc) -> None:
    d = bare
    version = d.api(lambda c: c.version())["version"]
    for path, code in (("/v1/status", 200), ("/v1/nope", 404),
                       ("/v1/workers/ghost/logs", 404), ("/v1/events?after=x", 400)):
        r = raw_get(d.socket, path)
        assert r.status_code == code, path
        assert r.headers["mlxceld-version"] == version
        if code >= 400:
            err = r.json()["error"]
            assert set(err) == {"code", "message", "hint"} and err["message"]


def test_a_body_nested_too_deeply_is_refused_and_the_daemon_unaffected(
        bare: DaemonProc) -> None:
    d = bare

    async def post(content: bytes) -> httpx.Response:
        transport = httpx.AsyncHTTPTransport(uds=str(d.socket))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await client.post("/v1/cluster/plan", content=content)

    for content in (b"[" * 200_000 + b"]" * 200_000, b'{"a": ' * 100_000 + b"{}" +
                    b"}" * 100_000):
        r = asyncio.run(post(content))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("the body is nested too deeply")
    assert d.status()["daemon"]["pid"] == d.pid
    assert "RecursionError" not in d.stderr() and "Traceback" not in d.stderr()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_a_process_of_another_uid_is_refused(bare: DaemonProc) -> None:
    d = bare
    code = textwrap.dedent(f"""
        import os, socket
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX)
        s.connect({str(d.socket)!r})
        s.sendall(b"GET /v1/status HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        print(data.decode())
    """)
    # Loosen the modes on purpose: the credential check must still refuse.
    with loosened(d):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("HTTP/1.1 403")
    body = json.loads(out.stdout.split("\n\n", 1)[1])  # text mode turned CRLF into LF
    assert body["error"]["code"] == "permission_denied"
    assert "uid 65534" in body["error"]["message"]


def test_every_command_speaks_json_with_a_schema(echo: DaemonProc) -> None:
    d = echo
    d.wait_worker("alpha", state="running")
    for args, schema in ((["status"], "status"), (["workers"], "workers"),
                         (["events"], "events"), (["version"], "version"),
                         (["restart", "alpha"], "restart")):
        out = d.ctl(*args, "--json")
        assert out.returncode == 0, (args, out.stderr)
        assert json.loads(out.stdout)["schema"] == f"mlxctl.{schema}/1"
    lines = d.ctl("logs", "alpha", "--json").stdout.splitlines()
    assert lines and all(json.loads(x)["schema"] == "mlxctl.log/1" for x in lines)


def test_logs_and_events_show_what_happened(echo: DaemonProc) -> None:
    d = echo
    d.wait_worker("alpha", state="running")
    logs = d.ctl("logs", "alpha", "-n", "5")
    assert logs.returncode == 0
    assert "worker alpha is ready" in logs.stdout
    events = d.ctl("events")
    assert "daemon.started" in events.stdout and "worker.running" in events.stdout
    missing = d.ctl("logs", "ghost")
    assert missing.returncode == 1 and "no worker named 'ghost'" in missing.stderr


def test_follow_streams_new_events(echo: DaemonProc) -> None:
    d = echo
    d.wait_worker("alpha", state="running")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxctl", "--socket", str(d.socket), "events", "-f", "-n", "1"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # the one past event
        time.sleep(0.5)
        assert d.ctl("restart", "alpha").returncode == 0
        seen = ""
        deadline = time.monotonic() + 15
        while "worker.restart_requested" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert "worker.restart_requested" in seen
    finally:
        proc.kill()
        proc.communicate()


def test_no_secret_reaches_a_worker_environment(daemons: Daemons) -> None:
    d = daemons.make(ONE_ECHO)
    env_secret = "s3cret-value-that-must-not-leak"
    os.environ["MLXCEL_CLUSTER_SECRET"] = env_secret
    try:
        d.start()
    finally:
        del os.environ["MLXCEL_CLUSTER_SECRET"]
    pid = d.wait_worker("alpha", state="running")["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert b"MLXCEL_CLUSTER_SECRET" not in environ and env_secret.encode() not in environ


def test_startup_errors_name_what_is_wrong(daemons: Daemons) -> None:
    d = daemons.make("[daemon]\nlog_levl = 'info'\n")
    bad_key = subprocess.run([sys.executable, "-m", "mlxceld", "--config", str(d.config),
                              "--state-dir", str(d.state_dir), "--socket", str(d.socket)],
                             capture_output=True, text=True, timeout=30)
    assert bad_key.returncode == 2
    assert "unknown key 'daemon.log_levl'" in bad_key.stderr and "hint:" in bad_key.stderr
    d.config.write_text("")
    long_socket = d.root / ("x" * 120) / "s.sock"
    too_long = subprocess.run([sys.executable, "-m", "mlxceld", "--config", str(d.config),
                               "--state-dir", str(d.state_dir), "--socket", str(long_socket)],
                              capture_output=True, text=True, timeout=30)
    assert too_long.returncode == 1
    assert "limit" in too_long.stderr and str(long_socket) in too_long.stderr
    assert not (d.state_dir / "state.db").exists()  # refused before touching anything


def test_idle_daemon_without_workers(bare: DaemonProc) -> None:
    d = bare
    out = d.ctl("status")
    assert out.returncode == 0
    assert "no workers configured" in out.stdout and "health: ok" in out.stdout
    wait_for(lambda: d.ctl("version").returncode == 0, 10, "version")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_mlxctl_as_another_uid_exits_4(bare: DaemonProc) -> None:
    d = bare
    # The interpreter lives under /root, which nobody cannot read: run mlxctl once as root
    # (so every module it needs is loaded), then drop to nobody and run it again.
    code = textwrap.dedent(f"""
        import contextlib, io, os
        from mlxctl.app import app
        args = ["--socket", {str(d.socket)!r}, "status"]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            app(args)
        os.setgid(65534); os.setuid(65534)
        app(args)
    """)
    run = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True,  # noqa: E731
                                 text=True, timeout=30)
    blocked = run()  # the 0700 directory stops it before the daemon sees it
    assert blocked.returncode == 4, blocked.stderr
    assert "permission denied" in blocked.stderr
    with loosened(d):
        refused = run()  # the daemon's credential check refuses it
    assert refused.returncode == 4, refused.stderr
    assert "uid 65534 is not allowed" in refused.stderr
