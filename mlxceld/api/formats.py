"""The two answer formats: ``chat.completion`` and ``text_completion``, whole or chunked.

A stream of chat chunks opens with a ``{"role": "assistant"}`` delta, carries
the text in content deltas, and closes with an empty delta and the finish
reason; text completion chunks carry the text in ``choices[0].text``. A chat answer's
reasoning goes in ``reasoning_content`` deltas (``reasoning``, or both keys, as
``[serve] reasoning_field`` says: ``reasoning.py``), each tool call in two chunks (its index,
id, type and name with arguments "", then its arguments), and a chat answer that called
tools finishes with "tool_calls". With
``stream_options.include_usage`` every chunk has ``"usage": null`` and a last
chunk with no choices carries the usage. With ``logprobs`` asked, every choice carries
the log-probabilities of its text's tokens (``logprobs.py``), a chunk those of its own
text; else ``logprobs`` is null.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mlxceld.api.generation import Finished
from mlxceld.api.logprobs import TokenLogprob, chat_logprobs, text_logprobs
from mlxceld.api.reasoning import ReasoningField, reasoning_keys
from mlxceld.api.shapes import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatFinishReason,
    Delta,
    TextCompletion,
    Usage,
)
from mlxceld.api.tools.calls import ToolCall
from mlxceld.api.tools.replies import PartKind
from mlxceld.engine import FinishReason

Chunk = ChatCompletionChunk | TextCompletion


def usage_of(finished: Finished) -> Usage:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` where the engine said how
    many prompt tokens its prompt cache gave (a local engine's, a pipeline's)."""
    usage: Usage = {"prompt_tokens": finished.prompt_tokens,
                    "completion_tokens": finished.completion_tokens,
                    "total_tokens": finished.prompt_tokens + finished.completion_tokens}
    if finished.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": finished.cached_tokens}
    return usage


@dataclass
class Answer:
    """A whole answer, gathered: its content, reasoning and tool calls."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every token's, in order

    def reason(self, finished: Finished) -> ChatFinishReason:
        return "tool_calls" if self.calls and finished.reason == "stop" else finished.reason


class Format(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def include_usage(self) -> bool: ...

    def whole(self, answer: Answer, finished: Finished) -> ChatCompletion | TextCompletion: ...
    def opening(self) -> list[Chunk]: ...
    def piece(self, text: str, kind: PartKind = "content",
              entries: Sequence[TokenLogprob] = ()) -> Chunk: ...
    def called(self, index: int, call: ToolCall) -> list[Chunk]: ...
    def closing(self, reason: ChatFinishReason) -> Chunk: ...
    def usage(self, finished: Finished) -> Chunk: ...


@dataclass(frozen=True)
class ChatFormat:
    id: str
    created: int
    model: str
    include_usage: bool = False
    logprobs: bool = False  # asked for: every choice carries them
    reasoning_field: ReasoningField = "reasoning_content"  # the key(s) of its reasoning

    def whole(self, answer: Answer, finished: Finished) -> ChatCompletion:
        message: AssistantMessage = {
            "role": "assistant",
            "content": None if answer.calls and not answer.content.strip() else answer.content}
        if answer.reasoning:
            keys = reasoning_keys(self.reasoning_field)
            if "reasoning_content" in keys:
                message["reasoning_content"] = answer.reasoning
            if "reasoning" in keys:
                message["reasoning"] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in answer.calls]
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": message,
                             "logprobs": chat_logprobs(answer.logprobs) if self.logprobs
                             else None,
                             "finish_reason": answer.reason(finished)}],
                "usage": usage_of(finished)}

    def opening(self) -> list[Chunk]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def piece(self, text: str, kind: PartKind = "content",
              entries: Sequence[TokenLogprob] = ()) -> Chunk:
        delta: Delta = {"content": text}
        if kind == "reasoning":
            keys = reasoning_keys(self.reasoning_field)
            delta = {"reasoning_content": text} if "reasoning_content" in keys else {}
            if "reasoning" in keys:
                delta["reasoning"] = text
        chunk = self._chunk(delta, None)
        if self.logprobs:
            chunk["choices"][0]["logprobs"] = chat_logprobs(entries)
        return chunk

    def called(self, index: int, call: ToolCall) -> list[Chunk]:
        return [
            self._chunk({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": ""}}]},
                        None),
            self._chunk({"tool_calls": [{"index": index,
                                         "function": {"arguments": call.arguments}}]}, None)]

    def closing(self, reason: ChatFinishReason) -> Chunk:
        return self._chunk({}, reason)

    def usage(self, finished: Finished) -> Chunk:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": usage_of(finished)}

    def _chunk(self, delta: Delta, reason: ChatFinishReason | None) -> ChatCompletionChunk:
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

    def whole(self, answer: Answer, finished: Finished) -> TextCompletion:
        completion = self._chunk(answer.content, finished.reason)
        if self.logprobs:
            completion["choices"][0]["logprobs"] = text_logprobs(answer.logprobs)
        completion["usage"] = usage_of(finished)
        return completion

    def opening(self) -> list[Chunk]:
        return []

    def piece(self, text: str, kind: PartKind = "content",
              entries: Sequence[TokenLogprob] = ()) -> Chunk:
        chunk = self._chunk(text, None)  # a text completion's text is never read for parts
        if self.logprobs:
            chunk["choices"][0]["logprobs"] = text_logprobs(entries)
        return chunk

    def called(self, index: int, call: ToolCall) -> list[Chunk]:
        raise AssertionError("a text completion has no tool calls")

    def closing(self, reason: ChatFinishReason) -> Chunk:
        assert reason != "tool_calls", "a text completion has no tool calls"
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
