"""Serving one Response: generate, answer whole or as OpenAI's Responses event stream.

As ``serving.CompletionResponse``: nothing is sent before the sequence's first event, so a
full queue (503), an engine that fails at once (500) or a client that leaves while queued
is answered (or not) with OpenAI's error JSON, never a half-open stream. Once the stream
has started, an engine failure is a ``response.failed`` event, which ends it. Each event
is named (``event: response.output_text.delta``) as OpenAI names them; the stream ends
without ``[DONE]``, as OpenAI's does.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from mlxceld.api.access import Usage, noted
from mlxceld.api.chatting import Chats, PreparedChat
from mlxceld.api.errors import ApiError, error_response, invalid
from mlxceld.api.generation import Event, Finished, Sequencer, TextPiece
from mlxceld.api.replies import Called
from mlxceld.api.requests import check_constraint, read_body
from mlxceld.api.responses import parse_responses
from mlxceld.api.responses_output import ResponseBuilder
from mlxceld.api.serving import failure
from mlxceld.api.streaming import start_events, until_disconnect
from mlxceld.engine import EngineError
from mlxceld.engine.constraints import ConstraintError

log = logging.getLogger(__name__)

TokenCounter = Callable[[str], Awaitable[int]]


def named_event(data: dict[str, Any]) -> bytes:
    """One server-sent event named by its ``type``, as OpenAI's Responses stream sends it."""
    return (f"event: {data['type']}\ndata: ".encode()
            + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")


class ResponsesResponse(Response):
    """An ASGI response that runs the sequence while it is sent, cancelled with it.
    ``count_tokens``: how many tokens a text is (the reasoning's, for its usage)."""

    def __init__(self, sequencer: Sequencer, prepared: PreparedChat, builder: ResponseBuilder,
                 *, arrived: float, count_tokens: TokenCounter) -> None:
        self._sequencer = sequencer
        self._prepared = prepared
        self._builder = builder
        self._arrived = arrived
        self._count = count_tokens
        self._usage = Usage()
        self._reasoning = ""
        self.background = None

    @property
    def _id(self) -> str:
        return self._prepared.request.request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._usage = noted(scope)
        self._usage.request_id = self._id
        self._usage.prompt_tokens = len(self._prepared.request.prompt_tokens)
        try:
            gone = await until_disconnect(receive, self._serve(scope, receive, send))
        except OSError:
            gone = True
        if gone:
            log.debug("request %s: the client went away; sequence cancelled", self._id)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        prepared = self._prepared
        events = self._sequencer.generate_text(prepared.request, prepared.stops,
                                               arrived=self._arrived, reply=prepared.reply)
        async with self._sequencer.draining.track(), aclosing(events):
            try:
                first = await anext(events)
            except Exception as exc:
                await self._refuse(exc, scope, receive, send)
                return
            if prepared.options.stream:
                await self._send_stream(first, events, send)
            else:
                await self._send_whole(first, events, scope, receive, send)

    async def _refuse(self, exc: Exception, scope: Scope, receive: Receive, send: Send) -> None:
        if isinstance(exc, EngineError):
            log.warning("request %s: the engine failed: %s", self._id, exc)
        elif not isinstance(exc, ApiError | ConstraintError):
            log.exception("request %s failed", self._id)
        await error_response(failure(exc))(scope, receive, send)

    def _feed(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, Called):
            return [e for call in event.calls for e in self._builder.called(call)]
        assert isinstance(event, TextPiece)
        if event.kind == "reasoning":
            self._reasoning += event.text
        return self._builder.piece(event.text, event.kind, event.logprobs)

    async def _send_whole(self, first: Event, events: AsyncIterator[Event], scope: Scope,
                          receive: Receive, send: Send) -> None:
        current = first
        try:
            while not isinstance(current, Finished):
                self._feed(current)
                current = await anext(events)
        except Exception as exc:
            await self._refuse(exc, scope, receive, send)
            return
        closing = await self._closing(current)
        await JSONResponse(closing[-1]["response"])(scope, receive, send)

    async def _send_stream(self, first: Event, events: AsyncIterator[Event], send: Send) -> None:
        await start_events(send)
        for data in self._builder.opening():
            await _send(send, data)
        current = first
        try:
            while not isinstance(current, Finished):
                for data in self._feed(current):
                    await _send(send, data)
                current = await anext(events)
        except Exception as exc:
            log.warning("request %s failed mid-stream: %s", self._id, exc,
                        exc_info=not isinstance(exc, EngineError))
            for data in self._builder.failed(failure(exc)):
                await _send(send, data)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        for data in await self._closing(current):
            await _send(send, data)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _closing(self, finished: Finished) -> list[dict[str, Any]]:
        self._usage.completion_tokens = finished.completion_tokens
        log.debug("request %s finished (%s): %d prompt tokens, %d completion tokens, %.3f s",
                  self._id, finished.reason, finished.prompt_tokens,
                  finished.completion_tokens, time.monotonic() - self._arrived)
        reasoning = await self._count(self._reasoning) if self._reasoning else 0
        return self._builder.closing(finished, min(reasoning, finished.completion_tokens))


async def _send(send: Send, data: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": named_event(data), "more_body": True})


def responses_route(chats: Chats) -> Callable[[Request], Awaitable[Response]]:
    """The ``POST /v1/responses`` endpoint over ``chats`` (the app's shared chat path)."""

    async def count_tokens(text: str) -> int:
        size = len(text.encode())
        return max(len(await chats.tokenizer.prompt(text, size)) - len(_overhead(chats)), 0)

    async def respond(request: Request) -> Response:
        arrived = chats.check_ready()
        parsed = parse_responses(await read_body(request, chats.max_body_bytes),
                                 model_id=chats.model_id, aliases=chats.names,
                                 defaults=chats.defaults)
        options = parsed.chat.options
        try:
            await check_constraint(options)
        except ApiError as exc:  # named as this endpoint names it
            raise invalid(exc.message.replace("'response_format'", "'text.format'"),
                          "text.format", exc.code) from None
        builder = ResponseBuilder(f"resp_{uuid.uuid4().hex}", int(time.time()),
                                  options.model, parsed.echo)
        prepared = await chats.prepare(parsed.chat, builder.id)
        return ResponsesResponse(chats.sequencer, prepared, builder, arrived=arrived,
                                 count_tokens=count_tokens)

    return respond


def _overhead(chats: Chats) -> list[int]:
    """The tokens the tokenizer adds to any text (a BOS), not counted as the text's."""
    return chats.codec.encode_prompt("")
