"""One sequence, from admission to its last piece of text.

``generate_text`` waits for an engine slot, streams the engine's token ids
through the codec's decoder and the stop strings, and yields text pieces, then
one ``Finished``. Closing it early (client gone) closes the engine's iterator,
which cancels the sequence, and frees the slot. By the time ``Finished`` is
yielded, the engine's iterator is closed and the slot is free.

Counting: ``completion_tokens`` counts every token the engine generated for
the sequence, the end-of-sequence token included (it was sampled and counts
against ``max_tokens``), as vLLM does; its text is never shown. A token the
codec calls end-of-sequence is taken as such even if the engine did not mark it.

A chat answer is read by its ``ChatReply`` (``replies.py``) after the stop strings: its
text pieces come out as content or reasoning, its tool calls as ``Called``; once the reply
is done (``parallel_tool_calls`` false, one call made) the sequence ends as at a stop
string.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from mlxceld.api.admission import Admission
from mlxceld.api.codec import TextCodec
from mlxceld.api.draining import Draining
from mlxceld.api.metrics import Metrics
from mlxceld.api.replies import Called, ChatReply, PartKind, Said
from mlxceld.api.stops import StopMatcher
from mlxceld.engine import Engine, FinishReason, GenerationRequest


@dataclass(frozen=True)
class TextPiece:
    text: str
    kind: PartKind = "content"


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


Event = TextPiece | Called | Finished


@dataclass(frozen=True)
class Sequencer:
    """What every sequence of one app runs through."""

    engine: Engine
    codec: TextCodec
    admission: Admission
    metrics: Metrics
    draining: Draining  # a drain's deadline ends the sequence (``next_output``)

    async def generate_text(self, request: GenerationRequest, stops: Sequence[str], *,
                            arrived: float, reply: ChatReply | None = None
                            ) -> AsyncGenerator[Event, None]:
        """``arrived``: the request's ``time.monotonic()``, for time to first token;
        ``reply``: how a chat answer is read (None: all its text is content)."""
        prompt_tokens = len(request.prompt_tokens)
        max_tokens = request.params.max_tokens
        decoder = self.codec.decoder()
        matcher = StopMatcher(stops)
        count = 0
        reason: FinishReason | None = None
        async with self.admission.slot():
            self.metrics.prompt_tokens.inc(prompt_tokens)
            last = arrived
            outputs = self.engine.generate(request)
            try:
                while True:
                    try:
                        output = await self.draining.next_output(outputs)
                    except StopAsyncIteration:
                        break
                    now = time.monotonic()
                    latency = self.metrics.inter_token_latency if count else \
                        self.metrics.time_to_first_token
                    latency.observe(now - last)
                    last = now
                    count += 1
                    self.metrics.completion_tokens.inc()
                    if output.finish_reason == "stop" or output.token in self.codec.eos_token_ids:
                        reason = "stop"
                        break
                    text = matcher.feed(decoder.add(output.token) if decoder.incremental
                                        else await asyncio.to_thread(decoder.add, output.token))
                    for piece in _read(text, reply):
                        yield piece
                    if matcher.stopped or (reply is not None and reply.done):
                        reason = "stop"
                        break
                    if output.finish_reason == "length" or count >= max_tokens:
                        reason = "length"
                        break
            finally:
                await outputs.aclose()
        if not matcher.stopped and not (reply is not None and reply.done):
            tail = matcher.feed(decoder.finish() if decoder.incremental
                                else await asyncio.to_thread(decoder.finish))
            tail += matcher.flush()
            for piece in _read(tail, reply):
                yield piece
            if matcher.stopped:  # the held-back end of the text completed a stop string
                reason = "stop"
        if reply is not None:
            for piece in _read(None, reply):
                yield piece
        if reason is None:  # the engine ended the sequence without saying why
            reason = "length" if count >= max_tokens else "stop"
        yield Finished(reason, prompt_tokens, count)


def _read(text: str | None, reply: ChatReply | None) -> list[TextPiece | Called]:
    """``text``'s events; None: the answer's end (what the reply still holds)."""
    if reply is None:
        return [TextPiece(text)] if text else []
    readings = reply.finish() if text is None else reply.feed(text) if text else []
    return [TextPiece(r.text, r.kind) if isinstance(r, Said) else r for r in readings]
