"""The control API: HTTP/JSON under ``/v1/...``, served on the daemon's Unix socket.

Every response carries the daemon's version (header ``Mlxceld-Version``);
errors are ``{"error": {"code", "message", "hint"}}`` (``errors.py`` has the
status of each). Streams (``follow=1``) are newline-delimited JSON with an empty
line as a heartbeat (``streams.py``), so a client can put a deadline on every read.

    GET    /v1/version, /v1/status, /v1/workers, /v1/cluster/nodes, /v1/secrets, /v1/drains
    GET    /v1/workers/{name}/logs    ?lines=N&follow=1
    GET    /v1/events                 ?after=ID&limit=N&subject=S&follow=1
    POST   /v1/workers/{name}/restart, /v1/serve, /v1/unserve, /v1/reload, /v1/stop
    POST   /v1/cluster/plan, /v1/cluster/activate, /v1/cluster/deactivate
    POST   /v1/cluster/link-test  {"peer", "pings", "size_mib"}
    POST   /v1/secrets, /v1/secrets/{kid}/primary, /v1/secrets/rotate
    POST   /v1/drain, /v1/undrain     {"node", "deadline_s", "force"}
    DELETE /v1/secrets/{kid}
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxceld import __version__
from mlxceld.control.endpoints import Endpoints
from mlxceld.control.errors import InternalErrors, domain_error, http_error
from mlxceld.control.view import DaemonView
from mlxceld.errors import MlxceldError


def build_app(view: DaemonView) -> ASGIApp:
    e = Endpoints(view)
    app = Starlette(
        routes=[
            Route("/v1/version", e.version),
            Route("/v1/status", e.status),
            Route("/v1/workers", e.workers),
            Route("/v1/cluster/nodes", e.cluster_nodes),
            Route("/v1/cluster/plan", e.plan, methods=["POST"]),
            Route("/v1/cluster/activate", e.activate, methods=["POST"]),
            Route("/v1/cluster/deactivate", e.deactivate, methods=["POST"]),
            Route("/v1/cluster/link-test", e.link_test, methods=["POST"]),
            Route("/v1/workers/{name}/restart", e.restart, methods=["POST"]),
            Route("/v1/workers/{name}/logs", e.logs),
            Route("/v1/events", e.events),
            Route("/v1/serve", e.serve, methods=["POST"]),
            Route("/v1/unserve", e.unserve, methods=["POST"]),
            Route("/v1/secrets", e.secrets),
            Route("/v1/secrets", e.install_secret, methods=["POST"]),
            Route("/v1/secrets/rotate", e.rotate_secret, methods=["POST"]),
            Route("/v1/secrets/{kid}/primary", e.use_secret, methods=["POST"]),
            Route("/v1/secrets/{kid}", e.remove_secret, methods=["DELETE"]),
            Route("/v1/drains", e.drains),
            Route("/v1/drain", e.drain, methods=["POST"]),
            Route("/v1/undrain", e.undrain, methods=["POST"]),
            Route("/v1/reload", e.reload, methods=["POST"]),
            Route("/v1/stop", e.stop, methods=["POST"]),
        ],
        middleware=[Middleware(InternalErrors)],
        exception_handlers={HTTPException: http_error, MlxceldError: domain_error},
    )
    return version_header(app)


def version_header(app: ASGIApp) -> ASGIApp:
    """Stamp ``Mlxceld-Version`` on every response, errors included."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"mlxceld-version", __version__.encode())]
            await send(message)

        await app(scope, receive, send_with_version if scope["type"] == "http" else send)

    return wrapped
