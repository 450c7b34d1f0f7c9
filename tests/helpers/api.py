"""Driving the router app: in process through httpx's ASGI transport, or on real uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import uvicorn
from starlette.types import ASGIApp

from mlxceld.api import TextCodec, build_router_app

from helpers.fakes import ByteCodec, FakeEngine
from helpers.waiting import until

BASE = "http://test"
MODEL = "fake-model"
KEY = "sk-test-key"


def make_app(engine: FakeEngine | None = None, codec: TextCodec | None = None,
             **options: Any) -> ASGIApp:
    options.setdefault("model_id", MODEL)
    return build_router_app(engine or FakeEngine(), codec or ByteCodec(), **options)


@contextlib.asynccontextmanager
async def http_client(app: ASGIApp, key: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE, headers=headers) as client:
        yield client


@contextlib.asynccontextmanager
async def openai_client(app: ASGIApp, key: str = KEY) -> AsyncIterator[openai.AsyncOpenAI]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)
    async with openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key=key, http_client=http,
                                  max_retries=0) as client:
        yield client


@contextlib.asynccontextmanager
async def serving(app: ASGIApp) -> AsyncIterator[str]:
    """The app on real uvicorn on a loopback port; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await until(lambda: server.started, "uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(5):
            await task
        sock.close()


def sse_events(text: str) -> list[Any]:
    """The data of each server-sent event; "[DONE]" stays a string."""
    assert text.endswith("\n\n"), text[-50:]
    events: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(text: str, name: str) -> float:
    """The value of one sample (``name`` with its labels, exactly) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no sample {name} in:\n{text}")


async def until_metric(client: httpx.AsyncClient, name: str, value: float,
                       timeout: float = 5.0) -> str:
    """Poll ``GET /metrics`` until sample ``name`` has ``value``; return the text."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        if f"\n{name} {float(value)}\n" in text:
            return text
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {name} = {value}:\n{text}")
