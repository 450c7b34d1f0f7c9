"""The control socket file kept in place: a deleted one is bound again (real uvicorn, a real
Unix socket, a real httpx client), what must not be replaced is left alone and reported once,
and a daemon refused the lock is told how to stop the holder."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from mlxceld.control import ControlServer, bind_control_socket, peer_guard
from mlxceld.control.keeper import SOCKET_CHECK_S, SocketKeeper, holder_hint


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


APP = peer_guard(Starlette(routes=[Route("/v1/hello", hello)]))
Events = list[tuple[str, str, str]]


@pytest.fixture
def path() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="mx", dir="/tmp"))  # short: sun_path has a limit
    yield root / "run" / "c.sock"
    shutil.rmtree(root, ignore_errors=True)


@contextlib.asynccontextmanager
async def kept(path: Path) -> AsyncIterator[tuple[SocketKeeper, Events]]:
    """A control server on ``path`` and its keeper; the events it reported."""
    server = ControlServer(APP, bind_control_socket(path), graceful_timeout_s=1.0)
    events: Events = []
    keeper = SocketKeeper(server, path, None, lambda *event: events.append(event))
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve(started))
    try:
        async with asyncio.timeout(5):
            await started
        yield keeper, events
    finally:
        keeper.close()
        server.request_shutdown()
        async with asyncio.timeout(5):
            await task


def client(path: Path) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=os.fspath(path)),
                             base_url="http://mlxceld")


async def answers(path: Path) -> bool:
    try:
        async with client(path) as c:
            return (await c.get("/v1/hello")).status_code == 200
    except httpx.TransportError:
        return False


def test_a_deleted_socket_is_bound_again_and_open_connections_go_on(path: Path) -> None:
    async def main() -> Events:
        async with kept(path) as (keeper, events), client(path) as old:
            assert (await old.get("/v1/hello")).status_code == 200  # a kept-alive connection
            assert not await keeper.restore("test")  # intact: nothing to do
            path.unlink()
            assert not await answers(path)
            assert await keeper.restore("test")
            assert await answers(path)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert (await old.get("/v1/hello")).status_code == 200  # the old one goes on
            assert not await keeper.restore("test")
            path.unlink()
            shutil.rmtree(path.parent)  # its directory too
            assert await keeper.restore("again")
            assert await answers(path)
            return events

    events = asyncio.run(main())
    assert events == [("restored", f"the control socket {path} was deleted; bound again", "test"),
                      ("restored", f"the control socket {path} was deleted; bound again",
                       "again")]


def test_a_file_in_its_place_is_left_alone_and_reported_once(path: Path) -> None:
    async def main() -> Events:
        async with kept(path) as (keeper, events):
            path.unlink()
            path.write_text("someone's file")
            assert not await keeper.restore("test")
            assert not await keeper.restore("test")
            assert path.read_text() == "someone's file"
            path.unlink()  # once it is gone, the socket comes back
            assert await keeper.restore("test")
            assert await answers(path)
            return events

    events = asyncio.run(main())
    assert [kind for kind, _, _ in events] == ["lost", "restored"]
    assert events[0][1] == (f"the control socket {path} was replaced by another file and cannot "
                            f"be bound again: {path} exists and is not a socket; refusing to "
                            "replace it")


def test_another_live_socket_in_its_place_is_not_taken(path: Path) -> None:
    async def main() -> Events:
        async with kept(path) as (keeper, events):
            path.unlink()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
                other.bind(os.fspath(path))
                other.listen(1)
                assert not await keeper.restore("test")
                inode = os.stat(path).st_ino
            assert os.stat(path).st_ino == inode  # still the other one's file
            return events

    events = asyncio.run(main())
    assert [kind for kind, _, _ in events] == ["lost"]
    assert "is in use by another mlxceld" in events[0][1]


def test_close_ends_the_periodic_check_at_once(path: Path) -> None:
    async def main() -> None:
        async with kept(path) as (keeper, _):
            task = asyncio.create_task(keeper.run())
            await asyncio.sleep(0)
            keeper.close()
            async with asyncio.timeout(SOCKET_CHECK_S / 2):
                await task

    asyncio.run(main())


def test_the_lock_holder_hint_says_how_to_stop_it(path: Path) -> None:
    assert holder_hint(4242, None) == ("stop it first: mlxctl stop, or kill -TERM 4242; or give "
                                       "this daemon another --state-dir")
    assert "kill -HUP 4242" in holder_hint(4242, path)  # nothing there
    assert f"its control socket {path} does not answer" in holder_hint(4242, path)
    with contextlib.closing(bind_control_socket(path)):
        assert holder_hint(4242, path) == (f"stop it first: mlxctl --socket {path} stop, or "
                                           "kill -TERM 4242; or give this daemon another "
                                           "--state-dir")
