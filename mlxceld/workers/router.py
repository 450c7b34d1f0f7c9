"""The ``router`` role: the OpenAI-compatible HTTP port in front of an engine.

Options (from ``[serve]`` / ``--model`` / ``mlxctl serve``): model, model_name, host,
port, max_batch, max_queued. The API key, if any, arrives on the bootstrap pipe.

Start-up binds the port first (a port in use fails at once, named), then loads the
model (the supervisor's start timeout covers it), then serves and reports ready.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from mlxceld.api import MlxTextCodec, build_router_app
from mlxceld.control.server import SocketServer
from mlxceld.engine.local import load_local_engine
from mlxceld.workers.runtime import WorkerContext

GRACEFUL_S = 10.0  # open streams get this long to finish when the router stops


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        raise RuntimeError(
            f"cannot listen on {host}:{port}: {exc.strerror}; is another server using the "
            "port? pick another with --port or [serve] port") from None
    sock.setblocking(False)
    return sock


async def run(ctx: WorkerContext) -> int:
    o: dict[str, Any] = ctx.options
    sock = listen(str(o["host"]), int(o["port"]))
    loop = asyncio.get_running_loop()
    broken: list[BaseException] = []

    def engine_broke(exc: BaseException) -> None:  # on the engine's thread
        broken.append(exc)
        loop.call_soon_threadsafe(ctx.stop)

    try:
        engine, tokenizer = await asyncio.to_thread(
            load_local_engine, str(o["model"]), model_id=str(o["model_name"]),
            max_batch=int(o["max_batch"]), on_failure=engine_broke)
    except Exception as exc:
        sock.close()
        raise RuntimeError(f"cannot load model {o['model']!r}: {exc}") from exc
    app = build_router_app(engine, MlxTextCodec(tokenizer), model_id=str(o["model_name"]),
                           api_key=ctx.api_key, max_queued=int(o["max_queued"]))
    server = SocketServer(app, sock, graceful_timeout_s=GRACEFUL_S)
    started: asyncio.Future[None] = loop.create_future()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(server.serve(started))
            await started
            ctx.stats.update(url=f"http://{o['host']}:{o['port']}/v1", model=o["model_name"])
            ctx.ready()
            await ctx.stopping.wait()
            server.request_shutdown()
    finally:
        await engine.aclose()
    if broken:  # exit non-zero: the supervisor restarts us with a fresh engine
        raise RuntimeError(f"the engine failed: {broken[0]!r}") from broken[0]
    return 0
