"""The optional API key: ``Authorization: Bearer <key>`` on every path but ``/health``.

Compared in constant time; neither the expected nor the offered key is ever
logged or echoed in an answer.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxceld.api.errors import ApiError, error_response


def require_api_key(app: ASGIApp, api_key: str, *, open_paths: Collection[str]) -> ASGIApp:
    expected = api_key.encode()

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in open_paths:
            await app(scope, receive, send)
            return
        offered = _bearer_token(scope)
        if offered is not None and hmac.compare_digest(offered, expected):
            await app(scope, receive, send)
            return
        message = ("missing API key: send it as 'Authorization: Bearer <key>'" if offered is None
                   else "invalid API key")
        refusal = ApiError(401, message, "invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        await error_response(refusal)(scope, receive, send)

    return guarded


def _bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            scheme, _, token = bytes(value).strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None
