"""Answering one generation: admit, generate, answer whole or as a stream, in an API's
format.

``SequenceResponse`` is what every generating endpoint shares: the sequence runs while the
answer is sent, and a client that leaves cancels it (``until_disconnect``); a drain waits
for it (``draining.track``). Nothing is sent before the sequence's first event (its first
text, or its end): a full queue (503), an engine that fails at once (500), or a client
that leaves while queued is answered, or not, without a half-open stream; that answer is
``failure``'s error in the API's error shape (``refusal``). Once a stream has started, a
failure is the API's error event and the stream ends. A stream's sequence never waits for
its client: a pump puts its events into a bounded outbox while the response writes it out
(``outbox.py``); a client too far behind has its sequence ended at once (``slow_reader``),
as has one that took nothing until the write deadline closed its connection. Each
endpoint's subclass supplies only its format: ``take`` (an event into the whole answer)
and ``whole``; ``opening``, ``chunks`` (an event's stream events), ``failed`` and
``closing``; ``END`` (OpenAI's chat and completions end with ``[DONE]``, the Responses
and Messages APIs with nothing).
``CompletionResponse`` is chat's and completions' (``formats.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any, ClassVar

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from mlxceld.api.edge.access import Usage, noted
from mlxceld.api.errors import ApiError, error_response
from mlxceld.api.formats import Answer, Format
from mlxceld.api.generation import Event, Finished, Sequencer, TextPiece
from mlxceld.api.outbox import Outbox, slow_reader_error, stalled
from mlxceld.api.requests import constraint_refused
from mlxceld.api.streaming import (
    DONE,
    end_events,
    event,
    send_event,
    start_events,
    until_disconnect,
)
from mlxceld.api.tools.replies import Called, ChatReply
from mlxceld.engine import EngineError, EngineUnavailable, GenerationRequest
from mlxceld.engine.constraints import ConstraintError
from mlxceld.tasks import scoped_group

log = logging.getLogger(__name__)


def failure(exc: Exception) -> ApiError:
    """What the client is told when generating failed: the server's fault, no detail
    beyond the engine's own message."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ConstraintError):  # the engine could not build the request's matcher
        return constraint_refused(exc)
    if isinstance(exc, EngineUnavailable):
        return ApiError(503, str(exc), "server_error", code="engine_unavailable",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineError):
        return ApiError(500, f"the engine failed: {exc}", "server_error", code="engine_error")
    return ApiError(500, "internal error while generating; see the server's log",
                    "server_error", code="internal_error")


class SequenceResponse(Response):
    """An ASGI response that runs the sequence while it is sent, cancelled with it; the
    subclass writes the API's format (the module's docstring lists its hooks)."""

    END: ClassVar[bytes] = b""  # the stream's last bytes, after its closing events

    def __init__(self, sequencer: Sequencer, request: GenerationRequest, stops: Sequence[str],
                 *, stream: bool, arrived: float, reply: ChatReply | None = None) -> None:
        self._sequencer = sequencer
        self._request = request
        self._stops = tuple(stops)
        self._stream = stream
        self._arrived = arrived
        self._reply = reply
        self._usage = Usage()  # the access log's, once called (api/edge/access.py)
        self._pumping = False  # a stream's sequence is running (``_pump``)
        self.background = None

    # The format's hooks.
    def refusal(self, error: ApiError) -> Response:
        """The answer to a request refused before anything was sent."""
        return error_response(error)

    def take(self, event: TextPiece | Called) -> None:
        """An event into the whole answer."""

    async def whole(self, finished: Finished) -> Any:
        """The whole answer's JSON, every event taken."""
        raise NotImplementedError

    def opening(self) -> list[bytes]:
        return []

    def chunks(self, event: TextPiece | Called) -> list[bytes]:
        """An event's stream events."""
        raise NotImplementedError

    def failed(self, error: ApiError) -> list[bytes]:
        """The events of a stream the engine failed after it started."""
        raise NotImplementedError

    async def closing(self, finished: Finished) -> list[bytes]:
        """The stream's last events, before ``END``."""
        raise NotImplementedError

    # The plumbing every format shares.
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._usage = noted(scope)
        self._usage.completion_id = self._request.request_id
        self._usage.prompt_tokens = len(self._request.prompt_tokens)
        try:
            gone = await until_disconnect(receive, self._serve(scope, receive, send))
        except OSError:  # a server that raises on sending to a closed connection
            gone = True
        if gone and self._pumping and stalled(scope):
            self._sequencer.slow_readers.cut(self._request.request_id,
                                             "it took nothing until the write deadline")
        elif gone:
            log.debug("request %s: the client went away; sequence cancelled",
                      self._request.request_id)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = self._sequencer.generate_text(self._request, self._stops, arrived=self._arrived,
                                               reply=self._reply)
        async with self._sequencer.draining.track(), aclosing(events):
            try:
                first = await anext(events)
            except Exception as exc:
                await self._refuse(exc, scope, receive, send)
                return
            if self._stream:
                await self._send_stream(first, events, send)
            else:
                await self._send_whole(first, events, scope, receive, send)

    async def _refuse(self, exc: Exception, scope: Scope, receive: Receive, send: Send) -> None:
        if isinstance(exc, EngineError):
            log.warning("request %s: the engine failed: %s", self._request.request_id, exc)
        elif not isinstance(exc, ApiError | ConstraintError):
            log.exception("request %s failed", self._request.request_id)
        await self.refusal(failure(exc))(scope, receive, send)

    async def _send_whole(self, first: Event, events: AsyncIterator[Event], scope: Scope,
                          receive: Receive, send: Send) -> None:
        current = first
        try:
            while not isinstance(current, Finished):
                self.take(current)
                current = await anext(events)
        except Exception as exc:
            await self._refuse(exc, scope, receive, send)
            return
        self._log_finished(current)
        await JSONResponse(await self.whole(current))(scope, receive, send)

    async def _send_stream(self, first: Event, events: AsyncGenerator[Event, None],
                           send: Send) -> None:
        """The pump fills the stream's outbox as the sequence goes, never waiting for the
        client; this task writes it out (``outbox.py``)."""
        outbox = Outbox()
        async with scoped_group() as tg:  # a writer gone (client gone) takes the pump along
            tg.create_task(self._pump(first, events, outbox))
            await start_events(send)
            while (data := await outbox.take()) is not None:
                await send_event(send, data)
            await end_events(send, b"")

    async def _pump(self, first: Event, events: AsyncGenerator[Event, None],
                    outbox: Outbox) -> None:
        """The sequence's events into ``outbox``; ``_pumping`` while the sequence runs (a
        pump cancelled, its client gone, leaves it set)."""
        self._pumping = True
        outbox.put(self.opening())
        current = first
        try:
            while not isinstance(current, Finished):
                if not await outbox.room(self.chunks(current)):
                    self._pumping = False
                    await self._cut(events, outbox)
                    return
                current = await anext(events)
        except Exception as exc:
            self._pumping = False
            log.warning("request %s failed mid-stream: %s", self._request.request_id, exc,
                        exc_info=not isinstance(exc, EngineError))
            outbox.close([*self.failed(failure(exc)), self.END])
            return
        self._pumping = False
        self._log_finished(current)
        outbox.close([*await self.closing(current), self.END])

    async def _cut(self, events: AsyncGenerator[Event, None], outbox: Outbox) -> None:
        """The client lags ``outbox.limit`` behind: end the sequence (its slot freed), and
        the stream with an error event after what is held."""
        await events.aclose()
        self._sequencer.slow_readers.cut(self._request.request_id,
                                         f"{outbox.size} bytes of its stream unread")
        outbox.close([*self.failed(failure(slow_reader_error(outbox.limit))), self.END])

    def _log_finished(self, finished: Finished) -> None:
        self._usage.completion_tokens = finished.completion_tokens
        log.debug("request %s finished (%s): %d prompt tokens, %d completion tokens, %.3f s",
                  self._request.request_id, finished.reason, finished.prompt_tokens,
                  finished.completion_tokens, time.monotonic() - self._arrived)


class CompletionResponse(SequenceResponse):
    """A chat completion or a completion, in OpenAI's format (``formats.Format``): a
    stream's events unnamed, ended by ``[DONE]``; a failure mid-stream the error's body."""

    END = DONE

    def __init__(self, sequencer: Sequencer, request: GenerationRequest, stops: Sequence[str],
                 fmt: Format, *, stream: bool, arrived: float,
                 reply: ChatReply | None = None) -> None:
        super().__init__(sequencer, request, stops, stream=stream, arrived=arrived, reply=reply)
        self._format = fmt
        self._answer = Answer()
        self._calls = 0  # the tool calls streamed so far

    def take(self, event: TextPiece | Called) -> None:
        if isinstance(event, Called):
            self._answer.calls.extend(event.calls)
            return
        self._answer.logprobs += event.logprobs
        if event.kind == "reasoning":
            self._answer.reasoning += event.text
        else:
            self._answer.content += event.text

    async def whole(self, finished: Finished) -> Any:
        return self._format.whole(self._answer, finished)

    def opening(self) -> list[bytes]:
        return [event(chunk) for chunk in self._format.opening()]

    def chunks(self, piece: TextPiece | Called) -> list[bytes]:
        if isinstance(piece, TextPiece):
            return [event(self._format.piece(piece.text, piece.kind, piece.logprobs))]
        out = []
        for call in piece.calls:
            out += [event(chunk) for chunk in self._format.called(self._calls, call)]
            self._calls += 1
        return out

    def failed(self, error: ApiError) -> list[bytes]:
        return [event(error.body())]

    async def closing(self, finished: Finished) -> list[bytes]:
        reason = "tool_calls" if self._calls and finished.reason == "stop" else finished.reason
        out = [event(self._format.closing(reason))]
        if self._format.include_usage:
            out.append(event(self._format.usage(finished)))
        return out
