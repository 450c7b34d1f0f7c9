"""The Messages API's answer: a ``message`` object whole, or Anthropic's server-sent
events (sans-IO: events in, bytes out).

A message's content is blocks, in the order the model wrote them: ``thinking`` (a reasoning
model's reasoning; ``signature`` ""), ``text``, and ``tool_use`` (``id`` ``toolu_...``,
``input`` the parsed object). Text that is only whitespace beside tool calls is no block.
An answer whose prompt opened the reasoning (thinking enabled on a template that opens
``<think>``) starts with its thinking block, there from the start: empty where the model
ended its turn at once or closed its reasoning before writing any (as an answer of
Anthropic's to a request with thinking on starts with one).

``stop_reason``: ``tool_use`` when the answer called tools, ``stop_sequence`` (with
``stop_sequence`` the one found) when one of the request's ended it, ``end_turn`` at the
model's end of turn, ``max_tokens`` at the request's ``max_tokens`` (or the operator's
bound), ``model_context_window_exceeded`` where what was left of the context was less
than ``max_tokens`` and ran out.

``usage``: ``input_tokens`` the prompt's tokens the prompt cache did not give,
``cache_read_input_tokens`` those it gave (Anthropic's split: their sum is the prompt),
``cache_creation_input_tokens`` 0 (caching here costs nothing), ``output_tokens`` every
token generated (the end-of-turn token too, as ``/v1/chat/completions`` counts).

A stream is ``message_start`` (the message with no content; its usage the whole prompt,
then corrected by ``message_delta``, which knows what the cache gave), a ``ping``, per
block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``, one
``input_json_delta`` with a call's whole input) and ``content_block_stop``, then
``message_delta`` (``stop_reason``, ``stop_sequence``, usage) and ``message_stop``. Each
event is ``event: NAME`` and ``data: JSON``; there is no ``[DONE]``. An error after the
start is an ``error`` event with Anthropic's error body (``anthropic_errors.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from mlxceld.api.anthropic_errors import anthropic_body
from mlxceld.api.errors import ApiError
from mlxceld.api.generation import Finished
from mlxceld.api.streaming import named_event
from mlxceld.api.tools.calls import ToolCall
from mlxceld.api.tools.replies import PartKind

LimitReason = Literal["max_tokens", "model_context_window_exceeded"]


def tool_id(call: ToolCall) -> str:
    """A call's id as Anthropic spells its tool-use ids."""
    return "toolu_" + call.id.removeprefix("call_")


def tool_use(call: ToolCall, *, whole: bool = True) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id(call), "name": call.name,
            "input": json.loads(call.arguments) if whole else {}}


@dataclass(frozen=True)
class MessageFormat:
    """``limit``: what ``max_tokens`` is called when the answer ran to its bound."""

    id: str
    model: str
    limit: LimitReason = "max_tokens"
    show_thinking: bool = True

    def stop_reason(self, finished: Finished, called: bool) -> str:
        if finished.reason == "length":
            return self.limit
        if called:
            return "tool_use"
        return "stop_sequence" if finished.stop_sequence is not None else "end_turn"

    def usage(self, finished: Finished) -> dict[str, Any]:
        cached = finished.cached_tokens or 0
        return {"input_tokens": finished.prompt_tokens - cached,
                "output_tokens": finished.completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                "service_tier": "standard"}

    def whole(self, blocks: list[dict[str, Any]], finished: Finished,
              called: bool) -> dict[str, Any]:
        if called:
            blocks = [b for b in blocks if b["type"] != "text" or b["text"].strip()]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": blocks, "stop_reason": self.stop_reason(finished, called),
                "stop_sequence": finished.stop_sequence if finished.reason == "stop" and
                not called else None,
                "usage": self.usage(finished)}

    def thinking(self, text: str) -> dict[str, Any]:
        return {"type": "thinking", "thinking": text if self.show_thinking else "",
                "signature": ""}


@dataclass
class MessageStream:
    """One streamed message's events, block by block."""

    format: MessageFormat
    index: int = 0
    open: Literal["thinking", "text"] | None = None
    held: str = ""  # leading whitespace of a text block not yet started
    called: bool = False
    thinking_first: bool = False  # the answer starts as reasoning: its block opens at once

    def start(self, prompt_tokens: int) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.format.id, "type": "message", "role": "assistant",
            "model": self.format.model, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        out = [named_event("message_start", {"type": "message_start", "message": message}),
               named_event("ping", {"type": "ping"})]
        if self.thinking_first:
            self._begin(out, self.format.thinking(""))
            self.open = "thinking"
        return out

    def piece(self, text: str, kind: PartKind) -> list[bytes]:
        out: list[bytes] = []
        if kind == "reasoning":
            if self.open != "thinking":
                self._close(out)
                self._begin(out, self.format.thinking(""))
                self.open = "thinking"
            if self.format.show_thinking and text:
                out.append(self._delta({"type": "thinking_delta", "thinking": text}))
            return out
        if self.open != "text":
            if not (self.held + text).strip():  # whitespace alone starts no block (yet)
                self.held += text
                return out
            text, self.held = self.held + text, ""
            self._close(out)
            self._begin(out, {"type": "text", "text": ""})
            self.open = "text"
        out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def calls(self, calls: tuple[ToolCall, ...]) -> list[bytes]:
        out: list[bytes] = []
        self._close(out)
        self.held = ""
        for call in calls:
            self._begin(out, tool_use(call, whole=False))
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": call.arguments}))
            self._stop(out)
        self.called = self.called or bool(calls)
        return out

    def finish(self, finished: Finished) -> list[bytes]:
        out: list[bytes] = []
        if self.held and not self.called:  # an answer of whitespace alone is still its text
            self._begin(out, {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": self.held}))
            self.open = "text"
        self._close(out)
        stop_sequence = finished.stop_sequence if finished.reason == "stop" and \
            not self.called else None
        usage = self.format.usage(finished)
        out.append(named_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": self.format.stop_reason(finished, self.called),
                      "stop_sequence": stop_sequence},
            "usage": {k: usage[k] for k in ("input_tokens", "output_tokens",
                                            "cache_creation_input_tokens",
                                            "cache_read_input_tokens")}}))
        out.append(named_event("message_stop", {"type": "message_stop"}))
        return out

    @staticmethod
    def error(error: ApiError) -> bytes:
        return named_event("error", anthropic_body(error))

    def _begin(self, out: list[bytes], block: dict[str, Any]) -> None:
        out.append(named_event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block}))

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_event("content_block_delta", {
            "type": "content_block_delta", "index": self.index, "delta": delta})

    def _stop(self, out: list[bytes]) -> None:
        out.append(named_event("content_block_stop", {
            "type": "content_block_stop", "index": self.index}))
        self.index += 1

    def _close(self, out: list[bytes]) -> None:
        if self.open is not None:
            self._stop(out)
            self.open = None
