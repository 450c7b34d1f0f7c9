"""CORS on the router port, opt-in: ``[serve] allowed_origins``.

Off by default (no origin allowed, no CORS header sent): a browser page of another
origin then cannot read the router's answers. With origins allowed (exact
``scheme://host[:port]`` origins, or ``"*"`` for any):

- a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) from
  an allowed origin is answered here, 204, before the API key is asked for (a browser
  sends no credentials on a preflight): ``Access-Control-Allow-Methods: GET, POST,
  OPTIONS``, ``Access-Control-Allow-Headers``: ``ALLOWED_HEADERS`` and those the
  preflight asks for (the OpenAI and Anthropic SDKs send headers of their own), and
  ``Access-Control-Max-Age: 600``. From any other origin it is refused, 403, in
  OpenAI's error shape, naming the origin and the setting;
- every other answer to an allowed origin carries ``Access-Control-Allow-Origin`` (the
  origin, or ``*`` when any is allowed) and ``Access-Control-Expose-Headers: *`` (so
  that a page reads ``x-request-id`` and ``Retry-After``); with a list of origins every
  answer carries ``Vary: Origin``, for caches. Credentials (cookies) are never allowed:
  the API key travels in a header.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxceld.api.errors import ApiError, error_response

ANY: Final = "*"
METHODS: Final = "GET, POST, OPTIONS"
ALLOWED_HEADERS: Final = ("authorization", "content-type", "x-api-key", "anthropic-version",
                          "anthropic-beta", "x-request-id", "openai-organization",
                          "openai-project")
MAX_AGE_S: Final = 600
_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP field name


def allow_origins(app: ASGIApp, origins: Sequence[str]) -> ASGIApp:
    """``app`` behind CORS for ``origins`` (lower case; ``"*"``: any)."""
    any_origin = ANY in origins
    allowed = frozenset(origins)

    async def cors(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        ok = origin is not None and (any_origin or origin.lower() in allowed)
        if (scope["method"] == "OPTIONS" and origin is not None
                and "access-control-request-method" in headers):
            answer = _preflight(origin, headers) if ok else error_response(ApiError(
                403, f"CORS: the origin {origin[:200]!r} is not allowed here; the server's "
                "[serve] allowed_origins lists those that are", code="origin_not_allowed"))
            if not any_origin:
                answer.headers["Vary"] = "Origin"
            await answer(scope, receive, send)
            return

        async def send_allowed(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                if not any_origin:
                    out.add_vary_header("Origin")
                if ok:
                    out["Access-Control-Allow-Origin"] = ANY if any_origin else str(origin)
                    out["Access-Control-Expose-Headers"] = "*"
            await send(message)

        await app(scope, receive, send_allowed)

    return cors


def _preflight(origin: str, headers: Headers) -> Response:
    asked = [h.strip().lower() for h in headers.get("access-control-request-headers",
                                                     "").split(",")]
    names = dict.fromkeys([*ALLOWED_HEADERS, *(h for h in asked if _TOKEN.fullmatch(h))])
    return Response(status_code=204, headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": METHODS,
        "Access-Control-Allow-Headers": ", ".join(names),
        "Access-Control-Max-Age": str(MAX_AGE_S)})
