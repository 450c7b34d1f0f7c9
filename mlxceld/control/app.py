"""The control API: HTTP/JSON under ``/v1/...``, served on the daemon's Unix socket.

Every response carries the daemon's version (header ``Mlxceld-Version``);
errors are ``{"error": {"code", "message", "hint"}}``. Streams (``follow=1``)
are newline-delimited JSON with an empty line as a heartbeat (``streams.py``),
so a client can put a deadline on every read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxceld import __version__
from mlxceld.control.streams import NDJSON, event_lines, log_lines
from mlxceld.control.view import DaemonView
from mlxceld.errors import (
    BringUpInProgress,
    KeyringError,
    MlxceldError,
    PlanRefused,
    PrimaryKeyRemoval,
    UnknownKey,
)
from mlxceld.supervisor import health
from mlxceld.types import JSON

MAX_LINES = 10_000
MAX_EVENTS = 1_000
MAX_STAGES = 64
API_VERSION = 1


def error(status: int, code: str, message: str, hint: str = "", **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "hint": hint, **extra}},
                        status_code=status)


def build_app(daemon: DaemonView) -> ASGIApp:
    def body(schema: str, **fields: Any) -> JSONResponse:
        return JSONResponse({"schema": f"mlxceld.{schema}/1", "version": __version__, **fields})

    async def version(request: Request) -> Response:
        return body("version", api=API_VERSION)

    async def status(request: Request) -> Response:
        current = daemon.status()
        stats = await daemon.worker_stats()  # bounded: supervisor.STATS_TIMEOUT_S
        for w in current["workers"]:
            w["stats"] = stats.get(w["name"])
        current["problems"] = health.problems(current["workers"])
        return body("status", **current)

    async def workers(request: Request) -> Response:
        return body("workers", workers=daemon.workers())

    async def cluster_nodes(request: Request) -> Response:
        return body("cluster_nodes", **daemon.cluster_nodes())

    async def restart(request: Request) -> Response:
        name = request.path_params["name"]
        if daemon.stopping:
            return _stopping()
        if daemon.log_path(name) is None:
            return _unknown_worker(name)
        daemon.restart_worker(name)
        return body("restart", worker=name, restarting=True)

    async def logs(request: Request) -> Response:
        name = request.path_params["name"]
        path = daemon.log_path(name)
        if path is None:
            return _unknown_worker(name)
        lines = _int_param(request, "lines", 50, 0, MAX_LINES)
        follow = request.query_params.get("follow") in ("1", "true")
        return StreamingResponse(log_lines(daemon, Path(path), lines, follow),
                                 media_type=NDJSON)

    async def events(request: Request) -> Response:
        after = _int_param(request, "after", -20, -MAX_EVENTS, 2**62)
        limit = _int_param(request, "limit", 100, 1, MAX_EVENTS)
        subject = request.query_params.get("subject") or None
        follow = request.query_params.get("follow") in ("1", "true")
        if not follow:
            items = [e.to_json() for e in daemon.events.since(after, limit, subject)]
            return body("events", events=items)
        return StreamingResponse(event_lines(daemon, after, limit, subject), media_type=NDJSON)

    async def plan(request: Request) -> Response:
        return await _planned(request, "plan", daemon.plan_cluster,
                              lambda planned: body("cluster_plan", **planned))

    async def activate(request: Request) -> Response:
        """Plan now, push and serve in the background: 202 with the bring-up (its epoch);
        `GET /v1/status` shows its progress as ``bringup``."""
        if daemon.stopping:
            return _stopping()
        return await _planned(request, "activate", daemon.activate_cluster,
                              lambda state: JSONResponse(
                                  {"schema": "mlxceld.cluster_activate/1",
                                   "version": __version__, "bringup": state},
                                  status_code=202))

    async def deactivate(request: Request) -> Response:
        """End the plan on every peer and stop the router (at most ``deactivation`` bounds:
        a dial and an answer per peer, in parallel, and the router's stop)."""
        if daemon.stopping:
            return _stopping()
        try:
            state = await daemon.deactivate_cluster()
        except BringUpInProgress as exc:
            return error(409, exc.code, exc.message, exc.hint)
        except MlxceldError as exc:
            return error(400, exc.code, exc.message, exc.hint)
        return body("cluster_deactivate", bringup=state)

    async def unserve(request: Request) -> Response:
        if daemon.stopping:
            return _stopping()
        try:
            return body("unserve", **await daemon.unserve())
        except MlxceldError as exc:
            return error(409, exc.code, exc.message, exc.hint)

    async def serve(request: Request) -> Response:
        if daemon.stopping:
            return _stopping()
        try:
            payload = await request.json()
            model, name = payload["model"], payload.get("model_name")
            if not isinstance(model, str) or not model or not isinstance(name, str | None):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return error(400, "bad_request", "body must be JSON: {\"model\": PATH-OR-REPO, "
                         "\"model_name\": optional string}", "see `mlxctl serve --help`")
        try:
            serving = await daemon.serve_model(model, name)
        except MlxceldError as exc:
            return error(400, "bad_model", exc.message, exc.hint)
        return body("serve", serving=serving)

    async def secrets(request: Request) -> Response:
        return body("secrets", keys=daemon.secrets())

    async def install_secret(request: Request) -> Response:
        try:
            payload = await request.json()
            secret = bytes.fromhex(payload["secret_hex"])
            primary = payload.get("primary", False)
            source = payload.get("source") or "the control API"
            if not isinstance(primary, bool) or not isinstance(source, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            # Never echo the body: it carries a secret.
            return error(400, "bad_request", "body must be JSON: {\"secret_hex\": HEX, "
                         "\"primary\": optional bool, \"source\": optional string}",
                         "see `mlxctl secret install --help`")
        return _keyring_call(lambda: body("secret", key=daemon.install_secret(
            secret, primary, source[:200])))

    async def use_secret(request: Request) -> Response:
        kid = request.path_params["kid"]
        return _keyring_call(lambda: body("secret", key=daemon.use_secret(kid)))

    async def remove_secret(request: Request) -> Response:
        kid = request.path_params["kid"]
        return _keyring_call(lambda: body("secret", key=daemon.remove_secret(kid),
                                          removed=True))

    async def stop(request: Request) -> Response:
        daemon.request_stop()
        return body("stop", stopping=True, pid=daemon.status()["daemon"]["pid"])

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return error(404, "not_found", f"no such endpoint: {request.method} "
                         f"{request.url.path}", "see `mlxctl --help` for what the API offers")
        if exc.status_code == 405:
            return error(405, "method_not_allowed",
                         f"{request.method} is not allowed on {request.url.path}")
        return error(exc.status_code, "http_error", str(exc.detail))

    async def bad_param(request: Request, exc: Exception) -> Response:
        return error(400, "bad_request", str(exc), "check the query parameters")

    app = Starlette(
        routes=[
            Route("/v1/version", version),
            Route("/v1/status", status),
            Route("/v1/workers", workers),
            Route("/v1/cluster/nodes", cluster_nodes),
            Route("/v1/cluster/plan", plan, methods=["POST"]),
            Route("/v1/cluster/activate", activate, methods=["POST"]),
            Route("/v1/cluster/deactivate", deactivate, methods=["POST"]),
            Route("/v1/workers/{name}/restart", restart, methods=["POST"]),
            Route("/v1/workers/{name}/logs", logs),
            Route("/v1/events", events),
            Route("/v1/serve", serve, methods=["POST"]),
            Route("/v1/unserve", unserve, methods=["POST"]),
            Route("/v1/secrets", secrets),
            Route("/v1/secrets", install_secret, methods=["POST"]),
            Route("/v1/secrets/{kid}/primary", use_secret, methods=["POST"]),
            Route("/v1/secrets/{kid}", remove_secret, methods=["DELETE"]),
            Route("/v1/stop", stop, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, ValueError: bad_param},
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


async def _planned(request: Request, command: str,
                   job: Callable[[str, int], Awaitable[JSON]],
                   answer: Callable[[JSON], JSONResponse]) -> JSONResponse:
    """``{"model": DIR, "stages": N}`` → ``job`` → ``answer``; its errors as answers."""
    try:
        payload = await request.json()
        model, stages = payload["model"], payload["stages"]
        if not isinstance(model, str) or not model or type(stages) is not int \
                or not 1 <= stages <= MAX_STAGES:
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return error(400, "bad_request", "body must be JSON: {\"model\": DIR, "
                     f"\"stages\": 1..{MAX_STAGES}}}", f"see `mlxctl cluster {command} --help`")
    try:
        result = await job(model, stages)
    except PlanRefused as exc:
        return error(409, exc.code, exc.message, exc.hint, shortfalls=list(exc.shortfalls))
    except BringUpInProgress as exc:
        return error(409, exc.code, exc.message, exc.hint)
    except MlxceldError as exc:
        return error(400, exc.code, exc.message, exc.hint)
    return answer(result)


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"query parameter {name!r} must be an integer, not {raw!r}") from None
    if not low <= value <= high:
        raise ValueError(f"query parameter {name!r} must be between {low} and {high}")
    return value


def _keyring_call(job: Callable[[], JSONResponse]) -> JSONResponse:
    """Run a keyring change; its errors (which name the key id) become error answers."""
    try:
        return job()
    except UnknownKey as exc:
        return error(404, exc.code, exc.message, exc.hint)
    except PrimaryKeyRemoval as exc:
        return error(409, exc.code, exc.message, exc.hint)
    except KeyringError as exc:
        return error(400, exc.code, exc.message, exc.hint)
    except MlxceldError as exc:
        return error(500, exc.code, exc.message, exc.hint)


def _unknown_worker(name: str) -> JSONResponse:
    return error(404, "unknown_worker", f"no worker named {name!r}",
                 "see `mlxctl workers` for the names")


def _stopping() -> JSONResponse:
    return error(503, "stopping", "the daemon is shutting down and admits no new work",
                 "wait for it to stop, then start it again")
