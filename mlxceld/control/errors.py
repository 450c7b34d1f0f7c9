"""The control API's error answers: ``{"error": {"code", "message", "hint"}}``, once.

Endpoints raise; nothing below them answers. An ``MlxceldError`` is answered
with the status of its nearest class in ``STATUS``, and its own code, message
and hint (``PlanRefused`` adds its ``shortfalls``; ``UnsupportedFamily`` its ``family`` and
the ``supported`` ones):

    status  class (code)                            e.g.
    400     BadRequest (bad_request)                ?after=x; a body field missing or mistyped
    400     ConfigError (config, bad_model, ...)    a cluster command on a daemon without a secret
    400     UnsupportedFamily (unsupported_family)  `mlxctl cluster plan` of a family not split
    400     KeyringError (keyring)                  a key id that is not 16 hex digits
    400     NoActivePlan (nothing_to_end)           `mlxctl cluster deactivate` with no plan
    413     RequestTooLarge (request_too_large)     a body over MAX_BODY_BYTES (requests.py)
    404     UnknownWorker (unknown_worker)          logs or restart of a worker that is not ours
    404     UnknownKey (unknown_key)                no installed secret has that key id
    404     UnknownNode (unknown_node)              `mlxctl drain` of a node not known here
    409     PlanRefused (plan_refused)              no plan fits the reachable nodes
    409     DrainRefused (drain_refused)            `mlxctl drain` on a stage host's daemon
    409     UnserveRefused (config)                 a restart would serve the model again
    409     PrimaryKeyRemoval (key_is_primary)      the primary secret cannot be removed
    409     BringUpInProgress (bringup_in_progress) one bring-up at a time
    409     RotationRefused (rotation_refused)      a member unreachable, or one rotation runs
    502     RotationFailed (rotation_failed)        a member failed a secret rotation's step
    502     LinkTestFailed (link_test_failed)       `mlxctl cluster link-test`: the peer
                                                    unreachable, silent or refusing
    503     ShuttingDown (stopping), DaemonError    the daemon is stopping
    500     MlxceldError (state, worker, ...)       the state or a worker failed us

Starlette's own 404 and 405 name the method and path. Anything else is a bug
of ours, never the caller's: 500 with a generic message (its text may say
anything, so it is not sent), and its traceback in the daemon's log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxceld.errors import (
    BadRequest,
    BringUpInProgress,
    ConfigError,
    DaemonError,
    DrainRefused,
    KeyringError,
    MlxceldError,
    NoActivePlan,
    PlanRefused,
    PrimaryKeyRemoval,
    RequestTooLarge,
    RotationFailed,
    RotationRefused,
    ShuttingDown,
    UnknownKey,
    UnknownNode,
    UnknownWorker,
    UnserveRefused,
    UnsupportedFamily,
)
from mlxceld.net.errors import LinkTestFailed

log = logging.getLogger(__name__)

STATUS: Final[Mapping[type[MlxceldError], int]] = {
    MlxceldError: 500,
    BadRequest: 400,
    ConfigError: 400,
    KeyringError: 400,
    NoActivePlan: 400,
    RequestTooLarge: 413,
    UnknownWorker: 404,
    UnknownKey: 404,
    UnknownNode: 404,
    PlanRefused: 409,
    DrainRefused: 409,
    UnserveRefused: 409,
    PrimaryKeyRemoval: 409,
    BringUpInProgress: 409,
    RotationRefused: 409,
    RotationFailed: 502,
    LinkTestFailed: 502,
    DaemonError: 503,
    ShuttingDown: 503,
}


def status_of(exc: MlxceldError) -> int:
    """The status of ``exc``'s nearest class in ``STATUS`` (the root's at worst)."""
    return next(STATUS[c] for c in type(exc).__mro__ if c in STATUS)


def error(status: int, code: str, message: str, hint: str = "", **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "hint": hint, **extra}},
                        status_code=status)


async def domain_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, MlxceldError)
    status = status_of(exc)
    if status >= 500:
        log.error("control API: %s %s failed: %s", request.method, request.url.path, exc)
    extra: dict[str, Any] = {}
    if isinstance(exc, PlanRefused):
        extra = {"shortfalls": list(exc.shortfalls)}
    elif isinstance(exc, UnsupportedFamily):
        extra = {"family": exc.family, "supported": list(exc.supported)}
    return error(status, exc.code, exc.message, exc.hint, **extra)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error(404, "not_found", f"no such endpoint: {request.method} "
                     f"{request.url.path}", "see `mlxctl --help` for what the API offers")
    if exc.status_code == 405:
        return error(405, "method_not_allowed",
                     f"{request.method} is not allowed on {request.url.path}")
    return error(exc.status_code, "http_error", str(exc.detail))


class InternalErrors:
    """ASGI middleware: what no handler answered is our bug, answered 500 and logged.

    A stream that fails once its answer has started cannot be answered again: the
    exception goes on up, and the server logs it and closes the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if started:
                raise
            method, path = scope["method"], scope["path"]
            log.exception("control API: %s %s failed", method, path)
            await error(500, "internal", f"the daemon failed to answer {method} {path}",
                        "a bug in mlxceld: the daemon's log has the traceback; please "
                        "report it")(scope, receive, send)
