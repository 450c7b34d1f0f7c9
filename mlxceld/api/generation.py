"""One sequence, from admission to its last piece of text.

``generate_text`` waits for an engine slot, streams the engine's token ids
through the codec's decoder and the stop strings, and yields text pieces, then
one ``Finished``. Closing it early (client gone) closes the engine's iterator,
which cancels the sequence, and frees the slot. By the time ``Finished`` is
yielded, the engine's iterator is closed and the slot is free. A stream's consumer (its
pump, ``answering.py``) never waits on the client between two events, so the slot is held
no longer than the engine takes (``outbox.py``).

Counting: ``completion_tokens`` counts every token the engine generated for
the sequence, the end-of-sequence token included (it was sampled and counts
against ``max_tokens``), as vLLM does; its text is never shown. A token the
codec calls end-of-sequence is taken as such even if the engine did not mark it.

With ``logprobs`` asked, each token's entry goes with the text it completes
(``logprobs.LogprobTracker``): on the first ``TextPiece`` made of that text, or on a
``TextPiece`` of its own with no text where the text made none (held back, a stop
string cut it, or it was a tool call's); the last piece carries those a stop string cut.

A chat answer is read by its ``ChatReply`` (``tools/replies.py``) after the stop strings: its
text pieces come out as content or reasoning, its tool calls as ``Called``; once the reply
is done (``parallel_tool_calls`` false, one call made) the sequence ends as at a stop
string. ``Finished.reasoning_tokens`` counts the generated tokens whose text lies inside
the reasoning (``TokenPlaces``: each token's place in the text), its markers not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from mlxceld.api.codec import TextCodec
from mlxceld.api.edge.admission import Admission
from mlxceld.api.edge.draining import Draining
from mlxceld.api.edge.metrics import Metrics
from mlxceld.api.logprobs import LogprobTracker, TokenLogprob
from mlxceld.api.outbox import SlowReaders
from mlxceld.api.stops import StopMatcher
from mlxceld.api.tools.replies import Called, ChatReply, PartKind, Said, TokenPlaces
from mlxceld.engine import Engine, FinishReason, GenerationRequest


@dataclass(frozen=True)
class TextPiece:
    text: str
    kind: PartKind = "content"
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # of the prompt's, from a prompt cache (None: unsaid)
    stop_sequence: str | None = None  # the request's stop string that ended it, if one did
    reasoning_tokens: int = 0  # of the completion's, those inside the answer's reasoning


Event = TextPiece | Called | Finished


@dataclass(frozen=True)
class Sequencer:
    """What every sequence of one app runs through."""

    engine: Engine
    codec: TextCodec
    admission: Admission
    metrics: Metrics
    draining: Draining  # a drain's deadline ends the sequence (``next_output``)
    slow_readers: SlowReaders  # sequences cut for a client that stopped reading

    async def generate_text(self, request: GenerationRequest, stops: Sequence[str], *,
                            arrived: float, reply: ChatReply | None = None
                            ) -> AsyncGenerator[Event, None]:
        """``arrived``: the request's ``time.monotonic()``, for time to first token;
        ``reply``: how a chat answer is read (None: all its text is content)."""
        prompt_tokens = len(request.prompt_tokens)
        max_tokens = request.params.max_tokens
        decoder = self.codec.decoder()
        matcher = StopMatcher(stops)
        tracker = (LogprobTracker(self.codec.token_bytes)
                   if request.params.logprobs is not None else None)
        places = TokenPlaces()  # for the reasoning's count
        count = 0
        cached: int | None = None
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
                    if not count:
                        cached = output.cached
                    count += 1
                    self.metrics.completion_tokens.inc()
                    if output.finish_reason == "stop" or output.token in self.codec.eos_token_ids:
                        reason = "stop"
                        break
                    made = (decoder.add(output.token) if decoder.incremental
                            else await asyncio.to_thread(decoder.add, output.token))
                    places.add(made)
                    text = matcher.feed(made)
                    entries: tuple[TokenLogprob, ...] = ()
                    if tracker is not None:
                        tracker.add(output, made)
                        entries = tracker.shown(text)
                    for piece in _read(text, reply, entries):
                        yield piece
                    if matcher.stopped or (reply is not None and reply.done):
                        reason = "stop"
                        break
                    if output.finish_reason == "length" or count >= max_tokens:
                        reason = "length"
                        break
            finally:
                await outputs.aclose()
        tail = ""
        if not matcher.stopped and not (reply is not None and reply.done):
            made = (decoder.finish() if decoder.incremental
                    else await asyncio.to_thread(decoder.finish))
            tail = matcher.feed(made)
            tail += matcher.flush()
            if tracker is not None:
                tracker.made(made)
            if matcher.stopped:  # the held-back end of the text completed a stop string
                reason = "stop"
        entries = () if tracker is None else tracker.shown(tail) + tracker.finish()
        for piece in _read(tail, reply, entries):
            yield piece
        if reply is not None:
            for piece in _read(None, reply):
                yield piece
        if reason is None:  # the engine ended the sequence without saying why
            reason = "length" if count >= max_tokens else "stop"
        reasoning = 0 if reply is None else places.within(reply.reasoning)
        yield Finished(reason, prompt_tokens, count, cached, matcher.matched, reasoning)


def _read(text: str | None, reply: ChatReply | None,
          entries: tuple[TokenLogprob, ...] = ()) -> list[TextPiece | Called]:
    """``text``'s events, the first text piece carrying ``entries`` (a piece of its own
    when none has text); ``text`` None: the answer's end (what the reply still holds)."""
    if reply is None:
        events: list[TextPiece | Called] = [TextPiece(text)] if text else []
    else:
        readings = reply.finish() if text is None else reply.feed(text) if text else []
        events = [TextPiece(r.text, r.kind) if isinstance(r, Said) else r for r in readings]
    if entries:
        first = next((i for i, e in enumerate(events) if isinstance(e, TextPiece)), None)
        if first is None:
            events.append(TextPiece("", logprobs=entries))
        else:
            piece = events[first]
            assert isinstance(piece, TextPiece)
            events[first] = TextPiece(piece.text, piece.kind, entries)
    return events
