"""The router's access log: one line per HTTP request, once its response has ended.

Logged by ``mlxceld.api.edge.access`` at INFO, in the router worker's log
(``<state-dir>/logs/router.log``; ``mlxctl logs router``)::

    POST /v1/chat/completions 200 prompt_tokens=12 completion_tokens=8 duration_ms=35.2
    request_id=4bf9... completion_id=chatcmpl-...   (one line)

and with ``--log-format json`` the same as fields of the line's object (``method``,
``path``, ``status``, ``prompt_tokens``, ``completion_tokens``, ``duration_ms``,
``request_id``, ``completion_id``; the tokens and the completion's id null when the
request had none). ``request_id`` is the answer's ``x-request-id`` (the client's, or
one made for it: ``edge/requestid.py``), ``completion_id`` the completion's ``id``.

``GET /health``, ``/ready`` and ``/metrics`` (``PROBE_PATHS``: what load balancers,
supervisors and Prometheus poll every few seconds) are logged at DEBUG, everything
else at INFO.

A streamed answer is logged when its stream ends, with its duration to that end.
``status`` is what was sent (499: the client went away before any response). The
path is logged without its query string, cut to ``MAX_PATH`` characters, its control
characters escaped; never a header (the API key), a prompt or a completion. uvicorn's
own access log stays off (``control/server.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxceld.api.edge.metrics import CLIENT_GONE

log = logging.getLogger("mlxceld.api.access")  # the name mlxceld(8) documents
MAX_PATH = 256  # characters of a path logged; a longer one is cut
# Polled by load balancers, supervisors and Prometheus, every few seconds: at DEBUG, so
# that a day of probes does not bury the requests (``--log-level debug`` shows them).
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
SCOPE_KEY = "mlxceld.access"  # where a request's ``Usage`` waits in its ASGI scope


@dataclass
class Usage:
    """What the handler learns of a request, for its access line (``noted``)."""

    request_id: str | None = None  # x-request-id (edge/requestid.py)
    completion_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def noted(scope: Scope) -> Usage:
    """The request's ``Usage``, to fill in (a fresh one when the app runs unlogged)."""
    usage = scope.get(SCOPE_KEY)
    return usage if isinstance(usage, Usage) else Usage()


def log_access(app: ASGIApp) -> ASGIApp:
    """``app`` with a line logged as each HTTP request's response ends."""

    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = time.monotonic()
        usage = Usage()
        scope[SCOPE_KEY] = usage
        status = CLIENT_GONE

        async def send_noted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await app(scope, receive, send_noted)
        except Exception:
            if status == CLIENT_GONE:
                status = "500"
            raise
        finally:
            _write(scope["method"], _clean(scope["path"]), int(status), usage,
                   (time.monotonic() - started) * 1000)

    return logged


def _write(method: str, path: str, status: int, usage: Usage, duration_ms: float) -> None:
    fields = {"method": method, "path": path, "status": status,
              "prompt_tokens": usage.prompt_tokens,
              "completion_tokens": usage.completion_tokens,
              "duration_ms": round(duration_ms, 1), "request_id": usage.request_id,
              "completion_id": usage.completion_id}
    level = logging.DEBUG if method == "GET" and path in PROBE_PATHS else logging.INFO
    log.log(level, "%s %s %d prompt_tokens=%s completion_tokens=%s duration_ms=%.1f "
            "request_id=%s completion_id=%s", method, path, status,
            _shown(usage.prompt_tokens), _shown(usage.completion_tokens), duration_ms,
            _shown(usage.request_id), _shown(usage.completion_id), extra={"fields": fields})


def _clean(path: str) -> str:
    """``path`` cut to ``MAX_PATH`` characters, control characters escaped: one line."""
    cut = path[:MAX_PATH] + ("..." if len(path) > MAX_PATH else "")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)


def _shown(value: object) -> str:
    return "-" if value is None else str(value)
