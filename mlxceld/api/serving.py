"""Serving one completion: admit, generate, answer whole or as a stream.

Nothing is sent before the sequence's first event (its first text, or its end):
a full queue (503), an engine that fails at once (500), or a client that
leaves while queued is answered, or not, without a half-open stream. Once the
stream has started, an engine failure is an SSE error event, then ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from mlxceld.api.access import Usage, noted
from mlxceld.api.errors import ApiError, error_response
from mlxceld.api.formats import Answer, Format
from mlxceld.api.generation import Event, Finished, Sequencer, TextPiece
from mlxceld.api.replies import Called, ChatReply
from mlxceld.api.requests import constraint_refused
from mlxceld.api.streaming import end_events, event, send_event, start_events, until_disconnect
from mlxceld.engine import EngineError, EngineUnavailable, GenerationRequest
from mlxceld.engine.constraints import ConstraintError

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


class CompletionResponse(Response):
    """An ASGI response that runs the sequence while it is sent, cancelled with it."""

    def __init__(self, sequencer: Sequencer, request: GenerationRequest, stops: Sequence[str],
                 fmt: Format, *, stream: bool, arrived: float,
                 reply: ChatReply | None = None) -> None:
        self._sequencer = sequencer
        self._reply = reply
        self._request = request
        self._stops = tuple(stops)
        self._format = fmt
        self._stream = stream
        self._arrived = arrived
        self._usage = Usage()  # the access log's, once called (api/access.py)
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._usage = noted(scope)
        self._usage.completion_id = self._request.request_id
        self._usage.prompt_tokens = len(self._request.prompt_tokens)
        try:
            gone = await until_disconnect(receive, self._serve(scope, receive, send))
        except OSError:  # a server that raises on sending to a closed connection
            gone = True
        if gone:
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
        error = failure(exc)
        if isinstance(exc, EngineError):
            log.warning("request %s: the engine failed: %s", self._request.request_id, exc)
        elif not isinstance(exc, ApiError | ConstraintError):
            log.exception("request %s failed", self._request.request_id)
        await error_response(error)(scope, receive, send)

    async def _send_whole(self, first: Event, events: AsyncIterator[Event], scope: Scope,
                          receive: Receive, send: Send) -> None:
        answer = Answer()
        current = first
        try:
            while not isinstance(current, Finished):
                if isinstance(current, Called):
                    answer.calls.extend(current.calls)
                else:
                    answer.logprobs += current.logprobs
                    if current.kind == "reasoning":
                        answer.reasoning += current.text
                    else:
                        answer.content += current.text
                current = await anext(events)
        except Exception as exc:
            await self._refuse(exc, scope, receive, send)
            return
        self._log_finished(current)
        await JSONResponse(self._format.whole(answer, current))(scope, receive, send)

    async def _send_stream(self, first: Event, events: AsyncIterator[Event], send: Send) -> None:
        await start_events(send)
        for chunk in self._format.opening():
            await send_event(send, event(chunk))
        current = first
        calls = 0
        try:
            while isinstance(current, TextPiece | Called):
                if isinstance(current, Called):
                    for call in current.calls:
                        for chunk in self._format.called(calls, call):
                            await send_event(send, event(chunk))
                        calls += 1
                else:
                    await send_event(send, event(self._format.piece(
                        current.text, current.kind, current.logprobs)))
                current = await anext(events)
        except Exception as exc:
            error = failure(exc)
            log.warning("request %s failed mid-stream: %s", self._request.request_id, exc,
                        exc_info=not isinstance(exc, EngineError))
            await send_event(send, event(error.body()))
            await end_events(send)
            return
        self._log_finished(current)
        reason = "tool_calls" if calls and current.reason == "stop" else current.reason
        await send_event(send, event(self._format.closing(reason)))
        if self._format.include_usage:
            await send_event(send, event(self._format.usage(current)))
        await end_events(send)

    def _log_finished(self, finished: Finished) -> None:
        self._usage.completion_tokens = finished.completion_tokens
        log.debug("request %s finished (%s): %d prompt tokens, %d completion tokens, %.3f s",
                  self._request.request_id, finished.reason, finished.prompt_tokens,
                  finished.completion_tokens, time.monotonic() - self._arrived)
