"""The control socket end to end: real uvicorn, a real Unix socket, a real httpx client."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxceld.control import (
    PEER_EXTENSION,
    SOCKET_PATH_LIMIT,
    ControlServer,
    PeerCredentials,
    bind_control_socket,
    check_socket_path,
    peer_guard,
    remove_socket_file,
)
from mlxceld.control.access import OperatorGroup
from mlxceld.errors import SocketError

NOBODY = 65534


async def whoami(request: Request) -> JSONResponse:
    creds = request.scope["extensions"][PEER_EXTENSION]
    assert isinstance(creds, PeerCredentials)
    return JSONResponse({"uid": creds.uid, "pid": creds.pid, "gid": creds.gid})


APP = peer_guard(Starlette(routes=[Route("/v1/whoami", whoami), Route("/v1/x", whoami)]))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # pytest's tmp_path is too long for sun_path on some machines.
    path = Path(tempfile.mkdtemp(prefix="mx", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def serving(path: Path) -> AsyncIterator[ControlServer]:
    server = ControlServer(APP, bind_control_socket(path), graceful_timeout_s=1.0)
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve(started))
    try:
        async with asyncio.timeout(5):
            await started
        yield server
    finally:
        server.request_shutdown()
        async with asyncio.timeout(5):
            await task


@contextlib.asynccontextmanager
async def client(path: Path) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.AsyncHTTPTransport(uds=os.fspath(path))
    async with httpx.AsyncClient(transport=transport, base_url="http://mlxceld") as c:
        yield c


def get(path: Path, url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def main() -> httpx.Response:
        async with serving(path), client(path) as c:
            return await c.get(url, headers=headers)

    return asyncio.run(main())


def test_app_sees_the_clients_real_uid_and_pid(short_dir: Path) -> None:
    response = get(short_dir / "c.sock", "/v1/whoami")
    assert response.status_code == 200
    assert response.json() == {"uid": os.getuid(), "pid": os.getpid(), "gid": os.getgid()}


def test_socket_is_0600_in_a_new_0700_directory(short_dir: Path) -> None:
    path = short_dir / "run" / "c.sock"

    async def main() -> tuple[int, int]:
        async with serving(path):
            return os.stat(path).st_mode, os.stat(path.parent).st_mode

    sock_mode, dir_mode = asyncio.run(main())
    assert stat.S_ISSOCK(sock_mode) and stat.S_IMODE(sock_mode) == 0o600
    assert stat.S_IMODE(dir_mode) == 0o700


def test_wider_existing_directory_is_tightened_to_0700(short_dir: Path) -> None:
    directory = short_dir / "run"
    directory.mkdir()
    directory.chmod(0o755)
    sock = bind_control_socket(directory / "c.sock")
    sock.close()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to any group needs root")
def test_an_operator_group_gets_the_socket_and_its_directory(short_dir: Path) -> None:
    os.chmod(short_dir, 0o711)  # the group may pass on the way, as through /run
    group = OperatorGroup.named(grp.getgrgid(NOBODY).gr_name)
    directory = short_dir / "run"
    directory.mkdir(mode=0o700)
    bind_control_socket(directory / "c.sock", group).close()
    for path, mode in ((directory / "c.sock", 0o660), (directory, 0o750)):
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, NOBODY), path
    # Without the group again, both are closed to it.
    bind_control_socket(directory / "c.sock").close()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory / "c.sock").st_mode) == 0o600


def test_a_group_that_could_not_reach_the_socket_is_refused(short_dir: Path) -> None:
    os.chmod(short_dir, 0o700)
    with pytest.raises(SocketError) as info:
        bind_control_socket(short_dir / "run" / "c.sock", OperatorGroup("ops", 424242))
    assert (f"members of group 'ops' (socket_group) cannot reach the control socket in "
            f"{short_dir / 'run'}: {short_dir} is mode 0700") in str(info.value)
    assert "--socket" in info.value.hint
    assert stat.S_IMODE(os.stat(short_dir / "run").st_mode) == 0o700  # left as it was
    assert not (short_dir / "run" / "c.sock").exists()


def test_umask_is_restored_after_bind(short_dir: Path) -> None:
    before = os.umask(0o022)
    try:
        bind_control_socket(short_dir / "c.sock").close()
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(before)


def test_too_long_path_is_refused_with_its_length_and_the_limit(short_dir: Path) -> None:
    path = short_dir / ("x" * 200)
    length = len(os.fsencode(path))
    with pytest.raises(SocketError) as info:
        bind_control_socket(path)
    assert str(path) in str(info.value)
    assert f"{length} bytes" in str(info.value)
    assert f"{SOCKET_PATH_LIMIT} bytes" in str(info.value)
    assert "--socket" in info.value.hint
    assert not path.exists()


def test_path_at_the_limit_is_accepted() -> None:
    check_socket_path(Path("/" + "x" * (SOCKET_PATH_LIMIT - 1)))


def test_regular_file_at_the_path_is_refused_and_kept(short_dir: Path) -> None:
    path = short_dir / "c.sock"
    path.write_text("precious")
    with pytest.raises(SocketError, match="not a socket") as info:
        bind_control_socket(path)
    assert str(path) in str(info.value)
    assert path.read_text() == "precious"


def test_stale_socket_file_is_replaced(short_dir: Path) -> None:
    path = short_dir / "c.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(os.fspath(path))  # bound, never listening, then closed: stale
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    assert get(path, "/v1/whoami").status_code == 200


def test_live_socket_of_another_listener_is_refused(short_dir: Path) -> None:
    path = short_dir / "c.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(os.fspath(path))
        live.listen(1)
        with pytest.raises(SocketError, match="in use by another mlxceld") as info:
            bind_control_socket(path)
        assert str(path) in str(info.value)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_sticky_shared_directory_is_refused(short_dir: Path) -> None:
    shared = short_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(SocketError, match="shared"):
        bind_control_socket(shared / "c.sock")
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_directory_owned_by_another_uid_is_refused(short_dir: Path) -> None:
    theirs = short_dir / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(SocketError, match=f"owned by uid {NOBODY}") as info:
        bind_control_socket(theirs / "c.sock")
    assert str(theirs) in str(info.value)
    assert stat.S_IMODE(os.stat(theirs).st_mode) == 0o755


def test_remove_socket_file_removes_only_sockets(short_dir: Path) -> None:
    path = short_dir / "c.sock"
    bind_control_socket(path).close()
    remove_socket_file(path)
    assert not path.exists()
    remove_socket_file(path)  # already gone: fine
    path.write_text("not ours")
    remove_socket_file(path)
    assert path.read_text() == "not ours"


@pytest.mark.parametrize("header", ["Origin", "Referer"])
def test_browser_originated_requests_are_refused(
    short_dir: Path, header: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mlxceld.control.server")
    response = get(short_dir / "c.sock", "/v1/whoami", {header: "http://evil.example"})
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "cross_origin_refused"
    assert "browser-originated" in error["message"]
    assert any("browser-originated" in r.getMessage() for r in caplog.records)


def test_scope_without_peer_credentials_is_refused() -> None:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=APP)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/v1/whoami")

    response = asyncio.run(main())
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"


STRANGER = 424242  # a uid and gid with no user and no group on this host


def as_peer(creds: PeerCredentials, group: OperatorGroup | None = None) -> ASGIApp:
    """``peer_guard`` as the server runs it, every request carrying ``creds`` (what
    ``ControlServer`` puts into each scope from the kernel's answer): the guard's decision
    for any uid, without root."""
    guarded = peer_guard(Starlette(routes=[Route("/v1/whoami", whoami)]), group)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        extensions = {**(scope.get("extensions") or {}), PEER_EXTENSION: creds}
        await guarded({**scope, "extensions": extensions}, receive, send)

    return app


def whoami_as(creds: PeerCredentials, group: OperatorGroup | None = None) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=as_peer(creds, group))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/v1/whoami")

    return asyncio.run(main())


def test_the_guard_admits_root_our_uid_and_the_groups_members_only() -> None:
    ops = OperatorGroup("ops", STRANGER)
    for creds, group in [(PeerCredentials(1, 0, 0), None),
                         (PeerCredentials(1, os.getuid(), STRANGER + 1), None),
                         (PeerCredentials(1, STRANGER, STRANGER), ops)]:
        response = whoami_as(creds, group)
        assert response.status_code == 200, (creds, group, response.text)
        assert response.json()["uid"] == creds.uid
    for creds, group in [(PeerCredentials(1, STRANGER, STRANGER), None),
                         (PeerCredentials(1, STRANGER, STRANGER + 1), ops),
                         (PeerCredentials(None, STRANGER, None), ops)]:
        response = whoami_as(creds, group)
        assert response.status_code == 403, (creds, group, response.text)
        error = response.json()["error"]
        assert error["code"] == "permission_denied"
        assert error["message"].startswith(f"uid {STRANGER} is not allowed to use")
        allowed = (f"only root and uid {os.getuid()} are" if group is None else
                   f"only root, uid {os.getuid()} and members of group 'ops' are")
        assert allowed in error["message"]
        assert ("group 'ops'" if group else "or as root") in error["hint"]


def test_the_guard_closes_a_strangers_websocket_before_accepting() -> None:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/whoami", "headers": [], "query_string": b"",
             "root_path": "", "scheme": "ws", "server": None, "client": None}
    asyncio.run(as_peer(PeerCredentials(1, STRANGER, STRANGER))(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]


def test_serving_installs_no_signal_handlers(short_dir: Path) -> None:
    watched = (signal.SIGTERM, signal.SIGINT)

    def handlers() -> dict[signal.Signals, object]:
        return {sig: signal.getsignal(sig) for sig in watched}

    async def main() -> tuple[dict[signal.Signals, object], dict[signal.Signals, object]]:
        # asyncio.run installs its own SIGINT handler: compare from inside the loop.
        before = handlers()
        async with serving(short_dir / "c.sock"), client(short_dir / "c.sock") as c:
            assert (await c.get("/v1/whoami")).status_code == 200
            return before, handlers()

    before, during = asyncio.run(main())
    assert during == before


def test_serve_closes_the_socket_and_leaves_the_file(short_dir: Path) -> None:
    path = short_dir / "c.sock"
    sock = bind_control_socket(path)

    async def main() -> None:
        server = ControlServer(APP, sock)
        server.request_shutdown()
        await server.serve()

    asyncio.run(main())
    assert sock.fileno() == -1
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    # and a later daemon takes the stale file over
    bind_control_socket(path).close()


def test_cancelled_serve_closes_the_socket(short_dir: Path) -> None:
    path = short_dir / "c.sock"
    sock = bind_control_socket(path)

    async def main() -> None:
        server = ControlServer(APP, sock)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(server.serve(started))
        await started
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert sock.fileno() == -1


OTHER_UID_CLIENT = """
import socket, sys, os
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.connect(sys.argv[1])
    s.sendall(b"GET /v1/x HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
sys.stdout.buffer.write(b"".join(chunks))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_uid_is_refused_even_through_open_modes(short_dir: Path) -> None:
    path = short_dir / "run" / "c.sock"

    async def main() -> subprocess.CompletedProcess[bytes]:
        async with serving(path):
            # Defence in depth: with the file system fence down, the credential check holds.
            short_dir.chmod(0o711)
            path.parent.chmod(0o711)
            path.chmod(0o666)
            return await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", OTHER_UID_CLIENT, os.fspath(path)],
                capture_output=True,
                timeout=10,
                check=False,
            )

    done = asyncio.run(main())
    assert done.returncode == 0, done.stderr.decode()
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 "), done.stdout
    error = json.loads(body)["error"]
    assert error["code"] == "permission_denied"
    assert f"uid {NOBODY} is not allowed" in error["message"]
    assert f"uid {os.getuid()} are" in error["message"]
