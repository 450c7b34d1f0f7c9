"""A listener's connection limits, on real uvicorn over loopback TCP and raw sockets:
the head's size and framing, the head and body deadlines, the cap and who goes first,
the log kept to a line per burst, and the file limit the cap stays below."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from mlxceld.control.server import CONTROL_LIMITS, ControlServer, SocketServer, peer_guard
from mlxceld.guard.connections import (
    MAX_HEADER_LINE_BYTES,
    MAX_HEADERS,
    RESERVED_FDS,
    ConnectionLimits,
)

from helpers.waiting import until


class Backend:
    """The app behind the listener: ``/ok``, ``/echo`` (reads the body; a client gone is
    recorded) and ``/hold`` (busy until ``release`` is set)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.gone: list[str] = []
        self.app = Starlette(routes=[Route("/ok", self.ok), Route("/hold", self.hold),
                                     Route("/echo", self.echo, methods=["POST"]),
                                     Route("/stream", self.stream)])

    async def ok(self, request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def hold(self, request: Request) -> JSONResponse:
        await self.release.wait()
        return JSONResponse({"held": True})

    async def stream(self, request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first"

        return StreamingResponse(chunks())

    async def echo(self, request: Request) -> JSONResponse:
        try:
            body = await request.body()
        except ClientDisconnect:
            self.gone.append(request.url.path)
            raise
        return JSONResponse({"length": len(body)})


@contextlib.asynccontextmanager
async def listening(backend: Backend, **limits: Any) -> AsyncIterator[tuple[int, SocketServer]]:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    port = sock.getsockname()[1]
    server = SocketServer(backend.app, sock, graceful_timeout_s=1.0,
                          limits=ConnectionLimits(**limits), what="the test port")
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve(started))
    try:
        async with asyncio.timeout(5):
            await started
        yield port, server
    finally:
        backend.release.set()
        server.request_shutdown()
        async with asyncio.timeout(10):
            await task


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def answer(reader: asyncio.StreamReader, timeout: float = 10.0
                 ) -> tuple[int | None, dict[str, str], Any]:
    """Read until the server closes: the status (None: closed without a word), the
    headers, and the JSON body."""
    async with asyncio.timeout(timeout):
        data = await reader.read()
    if not data:
        return None, {}, None
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


async def exchange(port: int, *parts: bytes) -> tuple[int | None, dict[str, str], Any]:
    reader, writer = await connect(port)
    for part in parts:
        writer.write(part)
        await writer.drain()
    status = await answer(reader)
    writer.close()
    return status


def error(body: Any) -> dict[str, str]:
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "hint"}, body
    err: dict[str, str] = body["error"]
    return err


GET_OK = b"GET /ok HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"


def test_a_large_or_crowded_head_is_431_and_a_doubly_framed_body_400() -> None:
    big = b"GET /ok HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    crowded = b"GET /ok HTTP/1.1\r\nHost: t\r\n" + b"X: y\r\n" * 10_000 + b"\r\n"
    one_over = b"GET /ok HTTP/1.1\r\n" + b"X: y\r\n" * MAX_HEADERS + b"Host: t\r\n\r\n"
    framed = (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")

    async def main() -> None:
        async with listening(Backend()) as (port, _):
            assert (await exchange(port, GET_OK))[0] == 200
            # One read holds the whole head (h11 would take it), or many reads do.
            status, headers, body = await exchange(port, big)
            assert status == 431 and headers["connection"] == "close"
            err = error(body)
            assert err["code"] == "request_header_too_large"
            assert "'X-Big'" in err["message"] and str(MAX_HEADER_LINE_BYTES) in err["message"]
            pieces = [big[i:i + 4096] for i in range(0, len(big), 4096)]
            status, _, body = await exchange(port, *pieces)
            assert status == 431 and "head" in error(body)["message"]
            for head in (crowded, one_over):
                status, _, body = await exchange(port, head)
                assert status == 431
                assert f"more than {MAX_HEADERS} headers" in error(body)["message"]
            status, _, body = await exchange(port, framed)
            assert status == 400 and "Transfer-Encoding" in error(body)["message"]
            status, _, body = await exchange(port, b"NOT HTTP\r\n\r\n")
            assert status == 400 and error(body)["code"] == "bad_request"

    asyncio.run(main())


def test_a_head_late_by_its_deadline_is_408_and_a_silent_connection_is_closed() -> None:
    async def main() -> None:
        async with listening(Backend(), header_timeout_s=0.5) as (port, _):
            silent, quiet = await connect(port)
            dripping_reader, dripping = await connect(port)
            began = time.monotonic()

            async def drip() -> None:  # a byte every 0.1 s never moves the deadline
                with contextlib.suppress(ConnectionError):
                    for byte in GET_OK:
                        dripping.write(bytes([byte]))
                        await asyncio.sleep(0.1)

            dripper = asyncio.create_task(drip())
            status, _, body = await answer(dripping_reader)
            took = time.monotonic() - began
            dripper.cancel()
            dripping.close()
            assert status == 408 and error(body)["code"] == "request_timeout"
            assert "within 0.5 s" in error(body)["message"]
            assert 0.4 < took < 4, took
            assert (await answer(silent))[0] is None  # closed without a word
            quiet.close()
            # A keep-alive connection idle after its answer is closed too.
            reader, writer = await connect(port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n")
            async with asyncio.timeout(10):
                assert (await reader.readuntil(b'{"ok":true}')).startswith(b"HTTP/1.1 200")
            assert (await answer(reader))[0] is None
            writer.close()

    asyncio.run(main())


def test_a_body_short_of_its_length_is_408_and_the_app_sees_the_client_gone() -> None:
    backend = Backend()

    async def main() -> None:
        async with listening(backend, body_timeout_s=0.5) as (port, _):
            head = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"
            status, _, body = await exchange(port, head + b"x" * 10)
            assert status == 408 and "body did not arrive within 0.5 s" in \
                error(body)["message"]
            await until(lambda: backend.gone == ["/echo"], "the app to see the client gone")
            status, _, body = await exchange(port, head.replace(b"\r\n\r\n", b"\r\n"
                                             b"Connection: close\r\n\r\n") + b"x" * 100)
            assert status == 200 and body == {"length": 100}

    asyncio.run(main())


def test_over_the_cap_the_connection_waiting_longest_goes_first() -> None:
    async def main() -> None:
        async with listening(Backend(), max_connections=4) as (port, server):
            oldest = await connect(port)
            await asyncio.sleep(0.05)
            others = [await connect(port) for _ in range(3)]
            await until(lambda: server.guard.open == 4, "4 connections open")
            newest_reader, newest = await connect(port)
            status, headers, body = await answer(oldest[0])
            assert status == 503 and headers["retry-after"] == "1"
            assert error(body)["code"] == "too_many_connections"
            assert "holds at most 4 connections" in error(body)["message"]
            newest.write(GET_OK)
            assert (await answer(newest_reader))[0] == 200
            newest.close()
            oldest[1].close()
            for reader, writer in others:  # still open: nothing to read yet
                assert not reader.at_eof()
                writer.write(GET_OK)
                assert (await answer(reader))[0] == 200
                writer.close()

    asyncio.run(main())


def test_a_request_in_progress_is_never_closed_for_the_cap() -> None:
    backend = Backend()

    async def main() -> None:
        async with listening(backend, max_connections=2) as (port, server):
            busy = []
            for _ in range(2):
                reader, writer = await connect(port)
                writer.write(GET_OK.replace(b"/ok", b"/hold"))
                busy.append((reader, writer))
            await until(lambda: server.guard.open == 2 and not server.guard._idle,
                        "two requests in the app")
            status, _, body = await exchange(port)
            assert status == 503
            assert "every other one has a request in progress" in error(body)["message"]
            backend.release.set()
            for reader, writer in busy:
                status, _, body = await answer(reader)
                assert status == 200 and body == {"held": True}
                writer.close()

    asyncio.run(main())


def test_a_flood_is_logged_once_per_burst(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mlxceld.control")

    async def main() -> None:
        async with listening(Backend(), max_connections=2, header_timeout_s=0.3) as (port, _):
            opened = [await connect(port) for _ in range(40)]
            bad = [exchange(port, b"X" * 100 + b"\r\n\r\n") for _ in range(20)]
            statuses = [status for status, _, _ in await asyncio.gather(*bad)]
            assert set(statuses) <= {400, 503}
            await asyncio.sleep(0.5)
            for _, writer in opened:
                writer.close()

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    evicted = [line for line in lines if "its cap" in line]
    refused = [line for line in lines if "refused a request" in line]
    assert len(evicted) == 1 and "the test port has 3 connections open" in evicted[0]
    assert len(refused) <= 1
    assert len(lines) <= 4, lines


def test_accept_failing_for_want_of_descriptors_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The file limit lowered under a running listener: every ``accept()`` fails with
    EMFILE, which asyncio reports a thousand times a second; one line, then it serves."""
    caplog.set_level(logging.INFO, logger="mlxceld.control.server")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    async def main() -> None:
        async with listening(Backend()) as (port, _):
            script = ("import socket, sys, time\n"
                      "s = [socket.create_connection(('127.0.0.1', int(sys.argv[1])))"
                      " for _ in range(20)]\n"
                      "print('open', flush=True); sys.stdin.read()")
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-c", script, str(port), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE)
            used = len(os.listdir("/dev/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (used, hard))
            try:
                assert client.stdout is not None and client.stdin is not None
                async with asyncio.timeout(10):
                    assert await client.stdout.readline() == b"open\n"
                await asyncio.sleep(1.5)  # asyncio retries after 1 s
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert (await exchange(port, GET_OK))[0] == 200
            client.stdin.close()
            await client.wait()

    asyncio.run(main())
    failed = [r.getMessage() for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(failed) >= 1 and "Too many open files" in failed[0]
    assert len(failed) <= 2, failed  # the line and the count of the rest


def test_the_control_socket_has_its_limits(state_dir: Path) -> None:
    from mlxceld.control.server import bind_control_socket

    async def main() -> None:
        sock = bind_control_socket(state_dir / "ctl.sock")
        server = ControlServer(peer_guard(Backend().app), sock)
        assert server.guard.limits == CONTROL_LIMITS
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(server.serve(started))
        await started
        try:
            reader, writer = await asyncio.open_unix_connection(str(state_dir / "ctl.sock"))
            writer.write(b"GET /ok HTTP/1.1\r\nHost: t\r\n" + b"X: y\r\n" * 200 + b"\r\n")
            status, _, body = await answer(reader)
            assert status == 431 and "hint" in error(body)
            writer.close()
        finally:
            server.request_shutdown()
            await task

    asyncio.run(main())


def test_the_file_limit_is_raised_and_the_cap_kept_below_it() -> None:
    script = """
import logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from mlxceld.guard.connections import connection_cap, raise_file_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
print("cap", connection_cap(1024, "the port"))
print("cap", connection_cap(1024, "the port", burst=64))
print("raised", raise_file_limit() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0])
print("cap", connection_cap(1024, "the port"))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    lines = out.splitlines()
    assert f"cap {256 - RESERVED_FDS}" in lines and f"cap {256 - RESERVED_FDS - 64}" in lines
    assert any("kept for the process itself and 64 for a burst of accepts" in line
               for line in lines)
    assert any("the port takes 128 connections, not 1024: the file limit is 256" in line
               for line in lines)
    assert "raised True" in lines
    assert lines[-1] == "cap 1024" or resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200


@pytest.mark.skipif(shutil.which("ss") is None, reason="reads the backlog with ss(8)")
def test_the_kernel_queues_the_listeners_backlog_and_asyncio_accepts_a_batch() -> None:
    async def main() -> None:
        sock = socket.create_server(("127.0.0.1", 0), backlog=1000)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        server = SocketServer(Backend().app, sock, backlog=1000, what="the test port")
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(server.serve(started))
        try:
            await started
            out = await asyncio.to_thread(subprocess.run, ["ss", "-ltnH", f"sport = :{port}"],
                                          capture_output=True, text=True, timeout=30)
            assert out.stdout.split()[2] == "1000", out.stdout  # Send-Q: the backlog
        finally:
            server.request_shutdown()
            await task

    asyncio.run(main())


def test_a_streamed_answer_is_not_held_back_for_the_clients_ack() -> None:
    """Every accepted TCP connection sends small writes at once (TCP_NODELAY). Without it,
    on a kept-alive connection the first chunk of a streamed answer waited behind its head
    for the client's delayed ACK: 40 ms and more, on every request but the first."""

    async def gaps() -> list[float]:
        loop = asyncio.get_running_loop()
        found = []
        async with listening(Backend()) as (port, _):
            reader, writer = await connect(port)
            for _ in range(5):
                writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
                async with asyncio.timeout(10):
                    await reader.readuntil(b"\r\n\r\n")  # the head
                    start = loop.time()
                    await reader.readuntil(b"first\r\n")  # the first chunk
                    found.append(loop.time() - start)
                    await reader.readuntil(b"0\r\n\r\n")  # the end
            writer.close()
        return found

    found = asyncio.run(gaps())
    assert min(found[1:]) < 0.02, [f"{g * 1000:.1f} ms" for g in found]
