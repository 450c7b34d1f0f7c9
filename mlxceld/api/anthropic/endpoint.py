"""The endpoint of ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's
Messages API) over the shared chat path (``chatting.py``).

A body is read and translated (``request.py``), prepared as every chat is (template,
tokens, tools, constraints), and run by the ``Sequencer``; its events are written as a
message or Anthropic's events (``anthropic/format.py``) by ``answering.SequenceResponse``:
nothing is sent before the sequence's first event, so a full queue, an engine that fails
at once or a client gone while queued gets a plain answer (Anthropic's error shape: the
app renders every refusal on these paths so, ``anthropic_errors.py``); once a stream has
started, a failure is an ``error`` event; a client that leaves cancels the sequence.

``max_tokens`` bounds the answer (``request.py``): the engine is asked for the least of
it, what is left of the context and the operator's ``[serve] max_tokens``.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxceld.api.answering import SequenceResponse
from mlxceld.api.anthropic.format import LimitReason, MessageFormat, MessageStream, tool_use
from mlxceld.api.anthropic.request import parse_messages
from mlxceld.api.anthropic_errors import anthropic_response
from mlxceld.api.chatting import Chats
from mlxceld.api.errors import ApiError
from mlxceld.api.generation import Finished, Sequencer, TextPiece
from mlxceld.api.tools.replies import Called, ChatReply
from mlxceld.engine import GenerationRequest


@dataclasses.dataclass(frozen=True)
class Messages:
    """The two routes' handlers over the app's ``Chats``."""

    chats: Chats

    async def create(self, request: Request) -> Response:
        chats = self.chats
        arrived = chats.check_ready()
        parsed = await chats.read(request, lambda body, ignored: parse_messages(
            body, model_id=chats.model_id, aliases=chats.names, defaults=chats.defaults,
            ignored=ignored))
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
        parsed = await chats.read(request, lambda body, ignored: parse_messages(
            body, model_id=chats.model_id, count=True, aliases=chats.names,
            ignored=ignored))
        prepared = await chats.prepare(parsed.chat, f"count_{uuid.uuid4().hex}")
        return JSONResponse({"input_tokens": len(prepared.request.prompt_tokens)})


class MessagesResponse(SequenceResponse):
    """A message, whole or as Anthropic's events (``anthropic/format.py``); a refusal
    before anything was sent in Anthropic's error shape."""

    def __init__(self, sequencer: Sequencer, request: GenerationRequest, stops: tuple[str, ...],
                 fmt: MessageFormat, *, stream: bool, arrived: float,
                 reply: ChatReply | None) -> None:
        super().__init__(sequencer, request, stops, stream=stream, arrived=arrived, reply=reply)
        self._format = fmt
        first = reply is not None and reply.starts_reasoning
        # a whole answer's, in the model's order; its thinking block first where the prompt
        # opened the reasoning, even empty (``anthropic/format.py``)
        self._blocks: list[dict[str, Any]] = [fmt.thinking("")] if first else []
        self._called = False
        self._events = MessageStream(fmt, thinking_first=first)

    def refusal(self, error: ApiError) -> Response:
        return anthropic_response(error)

    def take(self, event: TextPiece | Called) -> None:
        blocks = self._blocks
        if isinstance(event, Called):
            blocks.extend(tool_use(c) for c in event.calls)
            self._called = self._called or bool(event.calls)
            return
        if not event.text:
            return
        kind = "thinking" if event.kind == "reasoning" else "text"
        if not blocks or blocks[-1]["type"] != kind:
            blocks.append(self._format.thinking("") if kind == "thinking"
                          else {"type": "text", "text": ""})
        if kind == "text":
            blocks[-1]["text"] += event.text
        elif self._format.show_thinking:
            blocks[-1]["thinking"] += event.text

    async def whole(self, finished: Finished) -> Any:
        return self._format.whole(self._blocks, finished, self._called)

    def opening(self) -> list[bytes]:
        return self._events.start(len(self._request.prompt_tokens))

    def chunks(self, event: TextPiece | Called) -> list[bytes]:
        if isinstance(event, Called):
            return self._events.calls(event.calls)
        return self._events.piece(event.text, event.kind)

    def failed(self, error: ApiError) -> list[bytes]:
        return [MessageStream.error(error)]

    async def closing(self, finished: Finished) -> list[bytes]:
        return self._events.finish(finished)
