"""``x-request-id`` on every answer of the router port.

A request that sends a sane ``x-request-id`` (1 to ``MAX_CHARS`` printable ASCII
characters, no spaces) gets it back; any other request gets a fresh one (32 hex
digits). Every answer carries it: errors, unknown paths, refusals of the API key,
streams (in the head, before the first event). The access log's line shows it
(``request_id``, ``access.py``), so that a client's report finds the server's line.

It is not the completion's ``id``: that stays ``chatcmpl-``/``cmpl-`` and a fresh
UUID, unique per sequence in the engine, where a client may send one
``x-request-id`` twice (a retry) or for several requests of one task. The access
line carries both (``completion_id``).
"""

from __future__ import annotations

import uuid
from typing import Final

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxceld.api.edge.access import noted

HEADER: Final = "x-request-id"
MAX_CHARS: Final = 128


def offered_id(scope: Scope) -> str | None:
    """The client's ``x-request-id``, if it sent a sane one."""
    for name, value in scope["headers"]:
        if name.lower() == HEADER.encode():
            raw = bytes(value)
            if 1 <= len(raw) <= MAX_CHARS and all(0x21 <= b <= 0x7E for b in raw):
                return raw.decode("ascii")
            return None
    return None


def tag_requests(app: ASGIApp) -> ASGIApp:
    """``app`` with each HTTP answer carrying the request's ``x-request-id``."""

    async def tagged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        request_id = offered_id(scope) or uuid.uuid4().hex
        noted(scope).request_id = request_id

        async def send_tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await app(scope, receive, send_tagged)

    return tagged
