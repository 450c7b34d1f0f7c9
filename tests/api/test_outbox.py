"""A client that stops reading its stream holds no slot (``api/outbox.py``).

The outbox on its own, byte by byte; then the router app under the OpenAI port's guard
(``SocketServer`` with its write deadline and bounded send buffers) on loopback: a
client that never reads is cut, its slot freed at once, and what was held still reaches
it, ended by the ``slow_reader`` error event. The guard tells a request's app that it
closed the connection at the write deadline (``WRITE_STALLED``), and the app counts a
sequence still running then; a client that leaves by itself is not counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from mlxceld.api import refusal_body
from mlxceld.api.outbox import OUTBOX_BYTES, Outbox, stalled
from mlxceld.api.streaming import until_disconnect
from mlxceld.control.server import SocketServer
from mlxceld.guard.connections import SEND_BUFFER_BYTES, WRITE_STALLED, ConnectionLimits

from helpers.api import MODEL, http_client, make_app, metric, until_metric
from helpers.fakes import FakeEngine

pytestmark = pytest.mark.timeout(30)

CUT = "mlxceld_slow_readers_cut_total"


def test_the_outbox_holds_up_to_its_limit_and_gives_all_it_holds_at_once() -> None:
    async def main() -> None:
        box = Outbox(limit=10)
        assert box.put([b"abcdefghijkl"])  # empty: taken whatever its size
        assert not box.put([b"m"])  # past the limit: refused, nothing held
        assert box.size == 12 and await box.take() == b"abcdefghijkl" and box.size == 0
        assert box.put([b"abc", b"def"]) and box.put([b"ghij"])
        assert not box.put([b"k"])
        box.close([b"<end>", b"[DONE]"])  # the end, whatever the limit
        assert await box.take() == b"abcdefghij<end>[DONE]"
        assert await box.take() is None
        assert await box.take() is None

    asyncio.run(main())


def test_a_full_outbox_waits_briefly_for_its_writer_then_refuses() -> None:
    """A burst that fills the outbox before the writer's turn is held once the writer takes
    what is there; with no writer taking (its client stopped reading), nothing is held."""
    async def main() -> None:
        box = Outbox(limit=10)
        assert box.put([b"abcdefghij"])
        writer = asyncio.ensure_future(box.take())  # its turn comes after the pump's
        assert await box.room([b"klm"], within_s=1.0)
        assert await writer == b"abcdefghij" and box.size == 3
        assert box.put([b"nopqrst"])  # full again, and no writer takes
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert not await box.room([b"u"], within_s=0.2)
        assert loop.time() - began >= 0.2 and box.size == 10

    asyncio.run(main())


def test_the_writer_waits_for_the_pump() -> None:
    async def main() -> None:
        box = Outbox()
        taking = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        assert not taking.done()
        box.put([b"a"])
        assert await taking == b"a"
        taking = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        box.close()
        assert await taking is None

    asyncio.run(main())


@contextlib.asynccontextmanager
async def guarded(app: Any, write_stall_s: float) -> AsyncIterator[int]:
    """``app`` behind the OpenAI port's guard on a loopback port; yields the port."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    limits = ConnectionLimits(write_stall_s=write_stall_s, send_buffer_bytes=SEND_BUFFER_BYTES)
    server = SocketServer(app, sock, graceful_timeout_s=1.0, limits=limits,
                          render=refusal_body, what="the OpenAI port")
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve(started))
    try:
        async with asyncio.timeout(5):
            await started
        yield sock.getsockname()[1]
    finally:
        server.request_shutdown()
        async with asyncio.timeout(10):
            await task


async def unread(port: int, request: bytes) -> socket.socket:
    """A connection with a small receive buffer that sends ``request`` and reads nothing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(s, ("127.0.0.1", port))
    await loop.sock_sendall(s, request)
    return s


def post(path: str, body: Any) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def test_a_stream_whose_client_stops_reading_is_cut_and_frees_its_slot() -> None:
    async def main() -> None:
        engine = FakeEngine(max_batch=1, context_length=1 << 20)
        async with guarded(make_app(engine), write_stall_s=10.0) as port, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            s = await unread(port, post("/v1/completions", {
                "model": MODEL, "prompt": "slow", "stream": True, "max_tokens": 20_000,
                "logprobs": 5}))
            with s:
                await until_metric(client, CUT, 1)
                assert engine.cancelled == [engine.requests[0].request_id]
                await until_metric(client, "mlxceld_active_sequences", 0)
                again = await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "x", "max_tokens": 3})
                assert again.status_code == 200, again.text
                # What was held still comes, then the error event, once the client reads.
                data = b""
                loop = asyncio.get_running_loop()
                async with asyncio.timeout(10):
                    while not data.endswith(b"0\r\n\r\n"):
                        data += await loop.sock_recv(s, 1 << 16)
            assert len(data) > OUTBOX_BYTES
            tail = data[-2000:].decode()
            assert '"code": "slow_reader"' in tail and "data: [DONE]" in tail, tail

    asyncio.run(main())


def test_the_guard_tells_the_app_it_closed_a_stalled_connection() -> None:
    """An endless answer to a client that reads nothing: the write deadline closes the
    connection, and the app's scope says so; a client that leaves by itself: it does not."""
    ended: asyncio.Queue[bool] = asyncio.Queue()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async def endless() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            while True:
                await send({"type": "http.response.body", "body": b"x" * 4096,
                            "more_body": True})
                await asyncio.sleep(0)  # a send to a closed connection returns at once

        await until_disconnect(receive, endless())
        ended.put_nowait(stalled(scope))

    async def main() -> None:
        async with guarded(app, write_stall_s=0.3) as port:
            request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
            with await unread(port, request):
                async with asyncio.timeout(10):
                    assert await ended.get() is True
            s = await unread(port, request)
            await asyncio.sleep(0.05)
            s.close()
            async with asyncio.timeout(10):
                assert await ended.get() is False

    asyncio.run(main())


@pytest.mark.parametrize("at_the_deadline", [True, False])
def test_a_sequence_running_when_the_write_deadline_closes_is_counted(
        at_the_deadline: bool) -> None:
    """Through the ASGI seam: the stream's second write never returns (the client's
    buffers are full) while the sequence waits for its engine; the connection then ends,
    by the guard's write deadline or by the client."""

    async def main() -> None:
        engine = FakeEngine(max_batch=1, stall_after=2)
        app = make_app(engine)
        body = json.dumps({"model": MODEL, "prompt": "x", "stream": True}).encode()
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions",
            "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        gone = asyncio.Event()
        bodies: list[Message] = []
        requested = False

        async def receive() -> Message:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body":
                bodies.append(message)
                if len(bodies) > 1:
                    await asyncio.Event().wait()  # a write that never completes

        serving = asyncio.ensure_future(app(scope, receive, send))
        async with asyncio.timeout(5):
            while len(bodies) < 2 or not engine.active:
                await asyncio.sleep(0.01)
        if at_the_deadline:
            scope.setdefault("extensions", {})[WRITE_STALLED] = {}
        gone.set()
        async with asyncio.timeout(5):
            await serving
        assert engine.cancelled == [engine.requests[0].request_id]
        async with http_client(app) as client:
            text = (await client.get("/metrics")).text
        assert metric(text, CUT) == (1 if at_the_deadline else 0)

    asyncio.run(main())
