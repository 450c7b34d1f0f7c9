"""The daemon's ``GET /metrics`` listener (``[daemon] metrics_listen``): Prometheus text of
the daemon (``node.py``) and of its workers (``workers.py``), read afresh at each scrape.

A scrape asks every running or starting worker for its stats over its control channel,
all at once, each within the supervisor's deadline (``supervisor.service
.STATS_TIMEOUT_S``, the one ``mlxctl status`` keeps): a worker that does not answer in
time (stopped, stuck) is left out of the workers' lines and reads
``mlxceld_worker_scrape_ok 0``; the scrape never waits longer on it. Workers refresh
their stats every second, so a count may be up to a second old.

With an API key (``[serve] api_key_file``) and ``[serve] metrics_require_key`` (the
default), a scrape needs ``Authorization: Bearer <key>`` (``api/edge/auth.py``: compared in
constant time, answered 401 in OpenAI's error shape); the setting and the key are read
at each request, so a reload changes them (a rewritten key file: the old key refused at
once). Every other path is 404, another method 405. The
listener holds its connections to ``LIMITS`` (``guard/connections.py``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxceld.api.edge.auth import require_api_key
from mlxceld.api.edge.metrics import CONTENT_TYPE, build_info, process_metrics
from mlxceld.api.errors import refusal_body
from mlxceld.control.server import SocketServer
from mlxceld.control.view import DaemonView
from mlxceld.errors import DaemonError
from mlxceld.guard.connections import ConnectionLimits
from mlxceld.observe.node import Reading, daemon_families
from mlxceld.observe.workers import worker_families
from mlxceld.wire.address import HostPort

log = logging.getLogger(__name__)

LIMITS: Final = ConnectionLimits(max_connections=64, header_timeout_s=10.0,
                                 body_timeout_s=10.0)
GRACEFUL_S: Final = 2.0


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


async def scrape(view: DaemonView) -> bytes:
    """One scrape's text: the daemon's status first (which workers it asks), then every
    asked worker's stats, each bounded (see the module docstring)."""
    status = view.daemon.status()
    stats = await view.workers.stats()
    nodes = view.cluster.nodes().to_json()
    drains = [d.to_json() for d in view.drains.list()]
    rotation = view.cluster.rotation()
    reading = Reading(status, stats, nodes, drains, rotation.to_json() if rotation else None)
    families = [*process_metrics(), build_info("The versions this daemon runs"),
                *daemon_families(reading), *worker_families(stats)]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def metrics_app(view: DaemonView, api_key: Callable[[], str | None],
                require_key: Callable[[], bool]) -> ASGIApp:
    """``GET /metrics`` over ``view``; guarded while ``require_key()`` and ``api_key()``
    is a key (both asked at each request: a reload may change them)."""

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(await scrape(view), media_type=CONTENT_TYPE)

    app = Starlette(routes=[Route("/metrics", metrics)],
                    exception_handlers={404: _missing, 405: _missing})
    keyed = require_api_key(app, api_key, open_paths=())

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        await (keyed if require_key() else app)(scope, receive, send)

    return guarded


async def _missing(request: Request, exc: Exception) -> Response:
    return PlainTextResponse(f"{request.method} {request.url.path}: this listener serves "
                             "GET /metrics only\n",
                             status_code=getattr(exc, "status_code", 404))


def bind_metrics(address: HostPort) -> socket.socket:
    """A listening socket at ``address`` (a host name: the first address it resolves to);
    ``DaemonError`` naming the setting when it cannot be bound."""
    what = f"[daemon] metrics_listen = {str(address)!r}"
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        sock = socket.create_server(sockaddr, family=family, backlog=64)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise DaemonError(f"cannot serve /metrics on {address} ({what}): {why}",
                          hint="pick a free port, or leave metrics_listen unset") from None
    sock.setblocking(False)
    return sock


class MetricsServer:
    """The listener: bound at once (``bind_metrics``), serving from ``serve`` until
    ``close``."""

    def __init__(self, view: DaemonView, address: HostPort, api_key: Callable[[], str | None],
                 require_key: Callable[[], bool]) -> None:
        self.sock = bind_metrics(address)
        host, port = self.sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._server = SocketServer(metrics_app(view, api_key, require_key), self.sock,
                                    graceful_timeout_s=GRACEFUL_S, limits=LIMITS,
                                    render=refusal_body, what="the metrics listener")

    async def serve(self) -> None:
        log.info("serving /metrics on http://%s/metrics", self.address)
        await self._server.serve()

    def close(self) -> None:
        self._server.request_shutdown()
