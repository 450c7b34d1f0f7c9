"""Anthropic's error answer, for the Messages API's paths (``/v1/messages...``).

``{"type": "error", "error": {"type", "message"}}``, the status kept from the
``ApiError``; Anthropic's error type follows from the status (its own table: 400
``invalid_request_error``, 401 ``authentication_error``, 403 ``permission_error``,
404 ``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error``, 500
``api_error``, 503 and 529 ``overloaded_error``). A 503 stays a 503 (the router's
"full", "loading" and "draining" answers, with their ``Retry-After``): the ``anthropic``
package retries it as it retries Anthropic's 529. The field at fault, which OpenAI's
shape carries as ``param``, is named in the message, as Anthropic's messages name it.

Every refusal on those paths takes this shape: the app's exception handlers and the
API key's guard ask ``speaks_anthropic`` which one a path gets.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from mlxceld.api.errors import ApiError

PATH_PREFIX = "/v1/messages"
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
         503: "overloaded_error", 529: "overloaded_error"}


def speaks_anthropic(path: str) -> bool:
    """Whether ``path`` is the Messages API's, whose errors are Anthropic's."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def anthropic_type(status: int) -> str:
    if status in TYPES:
        return TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_type(error.status),
                                       "message": error.message}}


def anthropic_response(error: ApiError) -> JSONResponse:
    return JSONResponse(anthropic_body(error), status_code=error.status, headers=error.headers)
