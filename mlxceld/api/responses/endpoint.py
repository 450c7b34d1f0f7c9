"""The Responses endpoint: generate, answer whole or as OpenAI's Responses event stream.

``answering.SequenceResponse`` runs the sequence: nothing is sent before its first event, so
a full queue (503), an engine that fails at once (500) or a client that leaves while
queued is answered (or not) with OpenAI's error JSON, never a half-open stream. Once the
stream has started, an engine failure is a ``response.failed`` event, which ends it. Each
event is named (``event: response.output_text.delta``) as OpenAI names them; the stream
ends without ``[DONE]``, as OpenAI's does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mlxceld.api.answering import SequenceResponse
from mlxceld.api.chatting import Chats, PreparedChat
from mlxceld.api.errors import ApiError, invalid
from mlxceld.api.generation import Finished, TextPiece
from mlxceld.api.requests import check_constraint
from mlxceld.api.responses.output import ResponseBuilder
from mlxceld.api.responses.request import parse_responses
from mlxceld.api.streaming import named_event
from mlxceld.api.tools.replies import Called


def _named(events: list[dict[str, Any]]) -> list[bytes]:
    """The builder's events as sent: each named by its ``type``."""
    return [named_event(data["type"], data) for data in events]


class ResponsesResponse(SequenceResponse):
    """A Response, whole or streamed (``ResponseBuilder`` makes its events); its usage's
    ``reasoning_tokens`` are the sequencer's count (``Finished.reasoning_tokens``)."""

    def __init__(self, chats: Chats, prepared: PreparedChat, builder: ResponseBuilder,
                 *, arrived: float) -> None:
        super().__init__(chats.sequencer, prepared.request, prepared.stops,
                         stream=prepared.options.stream, arrived=arrived,
                         reply=prepared.reply)
        self._builder = builder

    def take(self, event: TextPiece | Called) -> None:
        self._events(event)

    async def whole(self, finished: Finished) -> Any:
        return self._closing(finished)[-1]["response"]

    def opening(self) -> list[bytes]:
        return _named(self._builder.opening())

    def chunks(self, event: TextPiece | Called) -> list[bytes]:
        return _named(self._events(event))

    def failed(self, error: ApiError) -> list[bytes]:
        return _named(self._builder.failed(error))

    async def closing(self, finished: Finished) -> list[bytes]:
        return _named(self._closing(finished))

    def _events(self, event: TextPiece | Called) -> list[dict[str, Any]]:
        if isinstance(event, Called):
            return [e for call in event.calls for e in self._builder.called(call)]
        return self._builder.piece(event.text, event.kind, event.logprobs)

    def _closing(self, finished: Finished) -> list[dict[str, Any]]:
        return self._builder.closing(finished, finished.reasoning_tokens)


async def respond(chats: Chats, request: Request) -> Response:
    """``POST /v1/responses`` over ``chats`` (the app's shared chat path)."""
    arrived = chats.check_ready()
    parsed = await chats.read(request, lambda body, ignored: parse_responses(
        body, model_id=chats.model_id, aliases=chats.names, defaults=chats.defaults,
        ignored=ignored))
    options = parsed.chat.options
    try:
        await check_constraint(options)
    except ApiError as exc:  # named as this endpoint names it (the schema: its own field)
        param = exc.param if exc.param == options.schema_param else "text.format"
        raise invalid(exc.message.replace("'response_format'", "'text.format'"),
                      param, exc.code) from None
    builder = ResponseBuilder(f"resp_{uuid.uuid4().hex}", int(time.time()),
                              options.model, parsed.echo)
    prepared = await chats.prepare(parsed.chat, builder.id)
    return ResponsesResponse(chats, prepared, builder, arrived=arrived)
