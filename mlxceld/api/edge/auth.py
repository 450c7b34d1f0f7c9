"""The optional API key: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
(Anthropic's header, which its SDK and Claude Code send) on every path but ``/health``.

Compared in constant time; neither the expected nor the offered key is ever
logged or echoed in an answer. A request that offers the key both ways is let in when
either is the key. The refusal is a 401 in OpenAI's error shape, or Anthropic's
(``authentication_error``) on the Messages API's paths.

The key is asked of ``api_key`` at every request, so that a new one takes effect at once:
the router worker's is its daemon's, pushed on a reload (the control channel's
``api_key`` op, ``supervisor/keys.py``); while it returns None every request is let in.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxceld.api.anthropic_errors import anthropic_response, speaks_anthropic
from mlxceld.api.errors import ApiError, error_response


def require_api_key(app: ASGIApp, api_key: Callable[[], str | None], *,
                    open_paths: Collection[str]) -> ASGIApp:
    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        key = api_key()
        if scope["type"] != "http" or scope["path"] in open_paths or key is None:
            await app(scope, receive, send)
            return
        expected = key.encode()
        offered = _offered_keys(scope)
        # Every offered key is compared (no early exit), each in constant time.
        matches = [hmac.compare_digest(offer, expected) for offer in offered]
        if any(matches):
            await app(scope, receive, send)
            return
        message = ("missing API key: send it as 'Authorization: Bearer <key>' or "
                   "'x-api-key: <key>'" if not offered else "invalid API key")
        refusal = ApiError(401, message, "invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        render = anthropic_response if speaks_anthropic(scope["path"]) else error_response
        await render(refusal)(scope, receive, send)

    return guarded


def _offered_keys(scope: Scope) -> list[bytes]:
    """The keys the request offers: the bearer token (b"" for another scheme) and the
    ``x-api-key`` header's value, where present."""
    keys: list[bytes] = []
    for name, value in scope["headers"]:
        lowered = name.lower()
        if lowered == b"authorization":
            scheme, _, token = bytes(value).strip().partition(b" ")
            keys.append(token.strip() if scheme.lower() == b"bearer" else b"")
        elif lowered == b"x-api-key":
            keys.append(bytes(value).strip())
    return keys
