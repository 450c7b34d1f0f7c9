"""The OpenAI port's stand-in while a tensor group across hosts is down
(daemon/tensor_standin.py), over real sockets: every request (``/ready`` too) gets 503
with the reason of now and ``Retry-After``, its body read first; a head that never ends
is answered 408 by the guard within its bound; once closed, the port is free for the
router."""

from __future__ import annotations

import asyncio
import socket

import httpx

from mlxceld.daemon.tensor_standin import CODE, HEAD_S, StandIn

from helpers.ports import free_port


def test_every_request_gets_503_naming_why_until_it_closes() -> None:
    port = free_port("127.0.0.1")
    why = ["tensor-parallel rank 1 on host 10.0.0.11:19000 is lost: gone"]

    async def go() -> None:
        standin = StandIn("127.0.0.1", port, lambda: why[0])
        await standin.open()
        assert standin.listening
        async with httpx.AsyncClient(timeout=10) as http:
            ready = await http.get(f"http://127.0.0.1:{port}/ready")
            assert ready.status_code == 503 and ready.json()["reason"] == why[0]
            why[0] = "forming"
            post = await http.post(f"http://127.0.0.1:{port}/v1/completions", json={"x": 1})
            assert post.status_code == 503 and post.headers["retry-after"] == "5"
            assert post.json()["error"] == {"message": "forming", "code": CODE,
                                            "type": "service_unavailable", "param": None}
            # a long chat's body is read before the answer: the client reads the 503, not
            # a reset
            messages = [{"role": "user", "content": "x" * 1000}] * 1000
            chat = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                   json={"model": "m", "messages": messages})
            assert chat.status_code == 503 and chat.json()["error"]["code"] == CODE
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ready HTTP/1.1\r\n")  # never ends its head
        got = await asyncio.wait_for(reader.read(), HEAD_S + 5)
        assert got.startswith(b"HTTP/1.1 408 ")  # the guard's answer within HEAD_S, closed
        writer.close()
        await standin.close()
        assert not standin.listening
        with socket.create_server(("127.0.0.1", port)):  # the router's to bind now
            pass

    asyncio.run(go())
