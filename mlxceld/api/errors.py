"""OpenAI's error answer: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal of the router port, from a malformed body to an unknown path, is
an ``ApiError``, rendered once by ``error_response``. ``ApiError`` is the HTTP
answer, not a fault of the daemon: it never leaves this room (the app turns it
into a response), so it stands outside the ``MlxceldError`` tree, the way
starlette's ``HTTPException`` stands outside a program's own errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import JSONResponse

from mlxceld.api.shapes import ErrorBody, ErrorType
from mlxceld.guard.connections import Refusal


class ApiError(Exception):
    """A request the router refuses, with the HTTP status and OpenAI's error fields.

    ``param`` names the offending field (``"messages[0].content"``, ``"max_tokens"``);
    ``code`` is a short machine-readable reason (``"model_not_found"``) or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type: ErrorType = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> ErrorBody:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def __repr__(self) -> str:
        return (f"ApiError({self.status}, {self.message!r}, param={self.param!r}, "
                f"code={self.code!r})")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400: the client's request is wrong, and ``message`` says how."""
    return ApiError(400, message, "invalid_request_error", param, code)


def refusal_body(refusal: Refusal) -> bytes:
    """A connection's refusal (too many connections, a late or oversized head: answered
    before the app sees the request) as OpenAI's error JSON."""
    kind: ErrorType = "server_error" if refusal.status >= 500 else "invalid_request_error"
    message = f"{refusal.message}; {refusal.hint}" if refusal.hint else refusal.message
    return json.dumps(ApiError(refusal.status, message, kind, code=refusal.code).body()).encode()
