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
from mlxceld.api.stops import StopMatcher
from mlxceld.engine import Engine, FinishReason, GenerationRequest


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


Event = TextPiece | Finished


@dataclass(frozen=True)
class Sequencer:
    """What every sequence of one app runs through."""

    engine: Engine
    codec: TextCodec
    admission: Admission
    metrics: Metrics
    draining: Draining  # a drain's deadline ends the sequence (``next_output``)

    async def generate_text(self, request: GenerationRequest, stops: Sequence[str], *,
                            arrived: float) -> AsyncGenerator[Event, None]:
        """``arrived``: the request's ``time.monotonic()``, for time to first token."""
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
                    if text:
                        yield TextPiece(text)
                    if matcher.stopped:
                        reason = "stop"
                        break
                    if output.finish_reason == "length" or count >= max_tokens:
                        reason = "length"
                        break
            finally:
                await outputs.aclose()
        if not matcher.stopped:
            tail = matcher.feed(decoder.finish() if decoder.incremental
                                else await asyncio.to_thread(decoder.finish))
            tail += matcher.flush()
            if tail:
                yield TextPiece(tail)
            if matcher.stopped:  # the held-back end of the text completed a stop string
                reason = "stop"
        if reason is None:  # the engine ended the sequence without saying why
            reason = "length" if count >= max_tokens else "stop"
        yield Finished(reason, prompt_tokens, count)
