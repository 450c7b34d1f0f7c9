"""``[serve] unknown_fields = "warn"``: unknown request fields ignored, and said so.

By default (``refuse``) a field no table of ``surface.py`` knows is a 400 naming it. An
operator whose clients send fields of their own (a proxy's, a newer SDK's) may choose
``warn`` instead: the request is served as if the field were absent, the router logs
one warning per distinct field name (not per request: the names logged are remembered,
up to ``MAX_REMEMBERED``, a message's index left out: ``messages[].x``), and the answer
carries ``x-mlxceld-ignored-fields: a, b`` naming what was ignored, streams too (their
headers go before the body). Known fields are checked as always: a refused one is still
a 400. It covers every endpoint that reads a body (``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses``, ``/v1/messages`` and its ``count_tokens``): each
reads it through ``chatting.Chats.read``, which hands the parser ``collector()``'s list
(``surface.check_fields`` puts the unknown paths there) and ``note``s it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Final, Literal, get_args

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

UnknownFields = Literal["refuse", "warn"]
UNKNOWN_FIELDS: Final[tuple[str, ...]] = get_args(UnknownFields)
HEADER: Final = "x-mlxceld-ignored-fields"
SCOPE_KEY: Final = "mlxceld.ignored_fields"
MAX_REMEMBERED: Final = 1024  # distinct names logged; past it, new ones are not logged
MAX_NAMED: Final = 16  # names in the header; the rest are counted
_INDEX = re.compile(r"\[\d+\]")


class IgnoredFields:
    """The operator's choice, the names ignored so far (to log each once) and the
    requests' header."""

    def __init__(self, unknown_fields: UnknownFields = "refuse") -> None:
        self.unknown_fields = unknown_fields
        self._logged: set[str] = set()

    def collector(self) -> list[str] | None:
        """Where a parser puts a request's unknown fields: a list under ``warn``; None
        (``refuse``): the parser refuses them."""
        return [] if self.unknown_fields == "warn" else None

    def note(self, scope: Scope, paths: Sequence[str] | None) -> None:
        """``paths`` were ignored in the request of ``scope``: log the new names, and
        have its answer name them."""
        if not paths:
            return
        names = list(dict.fromkeys(_INDEX.sub("[]", p) for p in paths))
        for name in names:
            if name not in self._logged and len(self._logged) < MAX_REMEMBERED:
                self._logged.add(name)
                log.warning("ignored the unknown request field %s ([serve] unknown_fields "
                            "= \"warn\"; logged once per name)", json.dumps(name))
        scope[SCOPE_KEY] = names


def header_value(names: Sequence[str]) -> str:
    """The names, escaped to ASCII (a header is latin-1), at most ``MAX_NAMED``."""
    shown = [json.dumps(n)[1:-1] for n in names[:MAX_NAMED]]
    more = [f"and {len(names) - MAX_NAMED} more"] if len(names) > MAX_NAMED else []
    return ", ".join(shown + more)


def announce_ignored(app: ASGIApp) -> ASGIApp:
    """``app`` whose answers carry ``HEADER`` when its request had fields ignored."""
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            names = scope.get(SCOPE_KEY)
            if message["type"] == "http.response.start" and names:
                headers = list(message.get("headers", []))
                headers.append((HEADER.encode(), header_value(names).encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await app(scope, receive, sending)

    return wrapped
