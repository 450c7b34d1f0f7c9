"""The two answer formats: ``chat.completion`` and ``text_completion``, whole or chunked.

A stream of chat chunks opens with a ``{"role": "assistant"}`` delta, carries
the text in content deltas, and closes with an empty delta and the finish
reason; text completion chunks carry the text in ``choices[0].text``. With
``stream_options.include_usage`` every chunk has ``"usage": null`` and a last
chunk with no choices carries the usage. With ``logprobs`` asked, every choice carries
the log-probabilities of its text's tokens (``logprobs.py``), a chunk those of its own
text; else ``logprobs`` is null.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mlxceld.api.generation import Finished
from mlxceld.api.logprobs import TokenLogprob, chat_logprobs, text_logprobs
from mlxceld.api.shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    Delta,
    TextCompletion,
    Usage,
)
from mlxceld.engine import FinishReason

Chunk = ChatCompletionChunk | TextCompletion


def usage_of(finished: Finished) -> Usage:
    return {"prompt_tokens": finished.prompt_tokens,
            "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens}


class Format(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def include_usage(self) -> bool: ...

    def whole(self, text: str, finished: Finished,
              entries: Sequence[TokenLogprob] = ()) -> ChatCompletion | TextCompletion: ...
    def opening(self) -> list[Chunk]: ...
    def piece(self, text: str, entries: Sequence[TokenLogprob] = ()) -> Chunk: ...
    def closing(self, reason: FinishReason) -> Chunk: ...
    def usage(self, finished: Finished) -> Chunk: ...


@dataclass(frozen=True)
class ChatFormat:
    id: str
    created: int
    model: str
    include_usage: bool = False
    logprobs: bool = False  # asked for: every choice carries them

    def whole(self, text: str, finished: Finished,
              entries: Sequence[TokenLogprob] = ()) -> ChatCompletion:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": chat_logprobs(entries) if self.logprobs else None,
                             "finish_reason": finished.reason}],
                "usage": usage_of(finished)}

    def opening(self) -> list[Chunk]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def piece(self, text: str, entries: Sequence[TokenLogprob] = ()) -> Chunk:
        chunk = self._chunk({"content": text}, None)
        if self.logprobs:
            chunk["choices"][0]["logprobs"] = chat_logprobs(entries)
        return chunk

    def closing(self, reason: FinishReason) -> Chunk:
        return self._chunk({}, reason)

    def usage(self, finished: Finished) -> Chunk:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": usage_of(finished)}

    def _chunk(self, delta: Delta, reason: FinishReason | None) -> ChatCompletionChunk:
        chunk: ChatCompletionChunk = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk


@dataclass(frozen=True)
class TextFormat:
    id: str
    created: int
    model: str
    include_usage: bool = False
    logprobs: bool = False  # asked for: every choice carries them

    def whole(self, text: str, finished: Finished,
              entries: Sequence[TokenLogprob] = ()) -> TextCompletion:
        completion = self._chunk(text, finished.reason)
        if self.logprobs:
            completion["choices"][0]["logprobs"] = text_logprobs(entries)
        completion["usage"] = usage_of(finished)
        return completion

    def opening(self) -> list[Chunk]:
        return []

    def piece(self, text: str, entries: Sequence[TokenLogprob] = ()) -> Chunk:
        chunk = self._chunk(text, None)
        if self.logprobs:
            chunk["choices"][0]["logprobs"] = text_logprobs(entries)
        return chunk

    def closing(self, reason: FinishReason) -> Chunk:
        return self._chunk("", reason)

    def usage(self, finished: Finished) -> Chunk:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [], "usage": usage_of(finished)}

    def _chunk(self, text: str, reason: FinishReason | None) -> TextCompletion:
        chunk: TextCompletion = {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk
