"""Serving ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's
Messages API) over the shared chat path (``chatting.py``).

A body is read and translated (``messages.py``), prepared as every chat is (template,
tokens, tools, constraints), and run by the ``Sequencer``; its events are written as a
message or Anthropic's events (``messages_format.py``). As in ``serving.py``: nothing is
sent before the sequence's first event, so a full queue, an engine that fails at once or
a client gone while queued gets a plain answer (Anthropic's error shape: the app renders
every refusal on these paths so, ``anthropic_errors.py``); once a stream has started, a
failure is an ``error`` event; a client that leaves cancels the sequence.

``max_tokens`` bounds the answer (``messages.py``): the engine is asked for the least of
it, what is left of the context and the operator's ``[serve] max_tokens``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from mlxceld.api.access import Usage, noted
from mlxceld.api.anthropic_errors import anthropic_response
from mlxceld.api.chatting import Chats
from mlxceld.api.errors import ApiError
from mlxceld.api.generation import Event, Finished, Sequencer
from mlxceld.api.messages import parse_messages
from mlxceld.api.messages_format import LimitReason, MessageFormat, MessageStream, tool_use
from mlxceld.api.replies import Called, ChatReply
from mlxceld.api.requests import read_body
from mlxceld.api.serving import failure
from mlxceld.api.streaming import send_event, start_events, until_disconnect
from mlxceld.engine import EngineError, GenerationRequest
from mlxceld.engine.constraints import ConstraintError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Messages:
    """The two routes' handlers over the app's ``Chats``."""

    chats: Chats

    async def create(self, request: Request) -> Response:
        chats = self.chats
        arrived = chats.check_ready()
        parsed = parse_messages(await read_body(request, chats.max_body_bytes),
                                model_id=chats.model_id, aliases=chats.names,
                                defaults=chats.defaults)
        message_id = f"msg_{uuid.uuid4().hex}"
        prepared = await chats.prepare(parsed.chat, message_id)
        params = prepared.request.params
        left = chats.engine.context_length - len(prepared.request.prompt_tokens)
        max_tokens = min(parsed.max_tokens, params.max_tokens)  # the latter: left, or less
        limit: LimitReason = "model_context_window_exceeded" \
            if parsed.max_tokens > left and max_tokens == left else "max_tokens"
        generation = dataclasses.replace(
            prepared.request, params=dataclasses.replace(params, max_tokens=max_tokens))
        fmt = MessageFormat(message_id, parsed.chat.options.model, limit, parsed.show_thinking)
        return MessagesResponse(chats.sequencer, generation, prepared.stops, fmt,
                                stream=prepared.options.stream, arrived=arrived,
                                reply=prepared.reply)

    async def count_tokens(self, request: Request) -> Response:
        chats = self.chats
        parsed = parse_messages(await read_body(request, chats.max_body_bytes),
                                model_id=chats.model_id, count=True, aliases=chats.names)
        prepared = await chats.prepare(parsed.chat, f"count_{uuid.uuid4().hex}")
        return JSONResponse({"input_tokens": len(prepared.request.prompt_tokens)})


class MessagesResponse(Response):
    """An ASGI response that runs the sequence while it is sent, cancelled with it."""

    def __init__(self, sequencer: Sequencer, request: GenerationRequest, stops: tuple[str, ...],
                 fmt: MessageFormat, *, stream: bool, arrived: float,
                 reply: ChatReply | None) -> None:
        self._sequencer = sequencer
        self._request = request
        self._stops = stops
        self._format = fmt
        self._stream = stream
        self._arrived = arrived
        self._reply = reply
        self._usage = Usage()
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._usage = noted(scope)
        self._usage.request_id = self._request.request_id
        self._usage.prompt_tokens = len(self._request.prompt_tokens)
        try:
            gone = await until_disconnect(receive, self._serve(scope, receive, send))
        except OSError:  # a server that raises on sending to a closed connection
            gone = True
        if gone:
            log.debug("request %s: the client went away; sequence cancelled",
                      self._request.request_id)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = self._sequencer.generate_text(self._request, self._stops,
                                               arrived=self._arrived, reply=self._reply)
        async with self._sequencer.draining.track(), aclosing(events):
            try:
                first = await anext(events)
                whole = None if self._stream else await self._gather(first, events)
            except Exception as exc:
                await anthropic_response(self._failed(exc))(scope, receive, send)
                return
            if whole is None:
                await self._send_stream(first, events, send)
                return
            blocks, finished, called = whole
            self._finished(finished)
            await JSONResponse(self._format.whole(blocks, finished, called))(scope, receive,
                                                                              send)

    def _failed(self, exc: Exception) -> ApiError:
        if isinstance(exc, EngineError):
            log.warning("request %s: the engine failed: %s", self._request.request_id, exc)
        elif not isinstance(exc, ApiError | ConstraintError):
            log.exception("request %s failed", self._request.request_id)
        return failure(exc)

    async def _gather(self, first: Event, events: AsyncIterator[Event]
                      ) -> tuple[list[dict[str, Any]], Finished, bool]:
        """A whole answer's blocks, in the order the model wrote them."""
        blocks: list[dict[str, Any]] = []
        called = False
        current = first
        while not isinstance(current, Finished):
            if isinstance(current, Called):
                blocks.extend(tool_use(c) for c in current.calls)
                called = called or bool(current.calls)
            elif current.text:
                kind = "thinking" if current.kind == "reasoning" else "text"
                if not blocks or blocks[-1]["type"] != kind:
                    blocks.append(self._format.thinking("") if kind == "thinking"
                                  else {"type": "text", "text": ""})
                if kind == "text":
                    blocks[-1]["text"] += current.text
                elif self._format.show_thinking:
                    blocks[-1]["thinking"] += current.text
            current = await anext(events)
        return blocks, current, called

    async def _send_stream(self, first: Event, events: AsyncIterator[Event],
                           send: Send) -> None:
        await start_events(send)
        stream = MessageStream(self._format)
        for chunk in stream.start(len(self._request.prompt_tokens)):
            await send_event(send, chunk)
        current = first
        try:
            while not isinstance(current, Finished):
                chunks = stream.calls(current.calls) if isinstance(current, Called) \
                    else stream.piece(current.text, current.kind)
                for chunk in chunks:
                    await send_event(send, chunk)
                current = await anext(events)
        except Exception as exc:
            log.warning("request %s failed mid-stream: %s", self._request.request_id, exc,
                        exc_info=not isinstance(exc, EngineError))
            await _end(send, MessageStream.error(failure(exc)))
            return
        self._finished(current)
        *chunks, last = stream.finish(current)
        for chunk in chunks:
            await send_event(send, chunk)
        await _end(send, last)

    def _finished(self, finished: Finished) -> None:
        self._usage.completion_tokens = finished.completion_tokens
        log.debug("request %s finished (%s): %d prompt tokens, %d completion tokens, %.3f s",
                  self._request.request_id, finished.reason, finished.prompt_tokens,
                  finished.completion_tokens, time.monotonic() - self._arrived)


async def _end(send: Send, last: bytes) -> None:
    """The last event, and the end of the stream: Anthropic's has no ``[DONE]``."""
    await send({"type": "http.response.body", "body": last, "more_body": False})
