"""Server-sent events, and serving a response only as long as the client is there.

OpenAI's chat and completions streams: each event is one ``data: <json>`` line and a
blank line (``event``); the stream ends with ``data: [DONE]`` (``DONE``). The Responses
and Messages APIs name each event (``named_event``: ``event: NAME`` before its data) and
end without ``[DONE]``. ``until_disconnect`` runs the work of a response beside a
watch on the ASGI ``receive`` channel, and cancels the work when the client
goes away, whether the response is streamed or not, sending or waiting.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Mapping
from typing import Any

from starlette.types import Receive, Send

from mlxceld.tasks import scoped_group

DONE = b"data: [DONE]\n\n"
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell proxies (nginx) not to buffer the stream
]


def event(data: Mapping[str, Any]) -> bytes:
    """One unnamed event, as OpenAI's chat and completions streams send them."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def named_event(name: str, data: Mapping[str, Any]) -> bytes:
    """One event with its name, as the Responses and Messages APIs send them."""
    return f"event: {name}\n".encode() + event(data)


async def start_events(send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})


async def send_event(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def end_events(send: Send, last: bytes = DONE) -> None:
    """The stream's ``last`` bytes (OpenAI's ``[DONE]``, or nothing), and its end."""
    await send({"type": "http.response.body", "body": last, "more_body": False})


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` (the request's body already read) until it ends or the client
    disconnects; return True if the client went away and ``work`` was cancelled.
    An exception of ``work`` propagates as itself (the caller catches its OSError)."""
    async with scoped_group() as tg:  # both end here: the one left is cancelled
        work_task = tg.create_task(work)
        watch_task = tg.create_task(_disconnected(receive))
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    return work_task.cancelled()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
