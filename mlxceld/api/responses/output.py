"""The Response object and its stream of events, built from a sequence's events (sans-IO).

``ResponseBuilder`` takes what the ``Sequencer`` yields (text pieces, content or reasoning;
tool calls; the end) and keeps the Response's ``output`` items: a ``reasoning`` item (its
text as ``content`` of ``reasoning_text``; no summary is made), a ``message`` item (one
``output_text`` part) and one ``function_call`` item per call, in the order the model
wrote them. Each call returns the stream events it makes, OpenAI's sequence:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning: response.content_part.added, response.reasoning_text.delta ...,
                 response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added, response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      call:      response.function_call_arguments.delta, ...arguments.done
    response.output_item.done,
    response.completed | response.incomplete (max_output_tokens) | response.failed

each with its ``sequence_number``. A whole answer uses the same builder and ignores the
events. Whitespace the model writes before a tool call, with no other content, makes no
message item (as chat's ``content`` is null then).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mlxceld.api.errors import ApiError
from mlxceld.api.generation import Finished
from mlxceld.api.logprobs import TokenLogprob, chat_logprobs
from mlxceld.api.shapes import ChatTokenLogprob
from mlxceld.api.tools.calls import ToolCall
from mlxceld.api.tools.replies import PartKind

Json = dict[str, Any]
Status = Literal["in_progress", "completed", "incomplete", "failed"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Open:
    """The text item being written: a reasoning item or a message."""

    kind: PartKind
    item: Json
    index: int
    text: str = ""
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)  # a message's, if asked


@dataclass
class ResponseBuilder:
    """One Response, from ``opening`` to ``closing`` (or ``failed``)."""

    id: str
    created_at: int
    model: str
    echo: Json  # the request's parameters the Response shows (``responses.py``)
    output: list[Json] = field(default_factory=list)
    _sequence: int = 0
    _open: _Open | None = None
    _pending: str = ""  # whitespace content not yet shown: it may precede a call
    _pending_logprobs: list[ChatTokenLogprob] = field(default_factory=list)  # its logprobs

    def response(self, status: Status, usage: Json | None = None,
                 incomplete: str | None = None, error: Json | None = None) -> Json:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": list(self.output),
                "error": error,
                "incomplete_details": None if incomplete is None else {"reason": incomplete},
                "usage": usage, **self.echo}

    def opening(self) -> list[Json]:
        created = self.response("in_progress")
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def piece(self, text: str, kind: PartKind,
              entries: Sequence[TokenLogprob] = ()) -> list[Json]:
        """``entries``: the logprobs of the tokens ``text`` completes (asked for): shown
        with a message's text; a reasoning's are not."""
        logprobs: list[ChatTokenLogprob] = \
            chat_logprobs(entries)["content"] if kind == "content" else []
        if kind == "content" and (self._open is None or self._open.kind != "content"):
            self._pending_logprobs += logprobs
            if not (self._pending + text).strip():
                self._pending += text
                return []
            text, self._pending = self._pending + text, ""
            logprobs, self._pending_logprobs = self._pending_logprobs, []
        elif not text and not logprobs:
            return []
        events = [] if self._open is not None and self._open.kind == kind else \
            self._close() + self._start(kind)
        assert self._open is not None
        self._open.text += text
        self._open.logprobs += logprobs
        delta = "response.output_text.delta" if kind == "content" else \
            "response.reasoning_text.delta"
        extra: Json = {"logprobs": logprobs} if kind == "content" else {}
        events.append(self._event(delta, item_id=self._open.item["id"],
                                  output_index=self._open.index, content_index=0, delta=text,
                                  **extra))
        return events

    def called(self, call: ToolCall) -> list[Json]:
        self._pending, self._pending_logprobs = "", []
        events = self._close()
        item: Json = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                      "call_id": call.id, "name": call.name, "arguments": ""}
        index = len(self.output)
        self.output.append(item)
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=dict(item)))
        events.append(self._event("response.function_call_arguments.delta",
                                  item_id=item["id"], output_index=index,
                                  delta=call.arguments))
        item.update(arguments=call.arguments, status="completed")
        events.append(self._event("response.function_call_arguments.done",
                                  item_id=item["id"], output_index=index, name=call.name,
                                  arguments=call.arguments))
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=dict(item)))
        return events

    def closing(self, finished: Finished, reasoning_tokens: int) -> list[Json]:
        """The last events; ``reasoning_tokens``: how many of the output reasoned."""
        incomplete = finished.reason == "length"
        events: list[Json] = []
        if self._pending or not self.output:  # an answer of whitespace, or of nothing
            events += self._close() + self._start("content")
            assert self._open is not None
            self._open.text, self._pending = self._pending, ""
            self._open.logprobs, self._pending_logprobs = self._pending_logprobs, []
        events += self._close("incomplete" if incomplete else "completed")
        usage = usage_of(finished, reasoning_tokens)
        if incomplete:
            final = self.response("incomplete", usage, "max_output_tokens")
            return [*events, self._event("response.incomplete", response=final)]
        final = self.response("completed", usage)
        return [*events, self._event("response.completed", response=final)]

    def failed(self, error: ApiError) -> list[Json]:
        """The events of a response that failed mid-stream (the engine's fault)."""
        events = self._close("incomplete")
        final = self.response("failed", None, None,
                              {"code": "server_error", "message": error.message})
        return [*events, self._event("response.failed", response=final)]

    def _start(self, kind: PartKind) -> list[Json]:
        index = len(self.output)
        if kind == "content":
            item: Json = {"id": _id("msg"), "type": "message", "status": "in_progress",
                          "role": "assistant", "content": []}
            part: Json = {"type": "output_text", "text": "", "annotations": [],
                          "logprobs": []}
        else:
            item = {"id": _id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self._open = _Open(kind, item, index)
        return [self._event("response.output_item.added", output_index=index,
                            item=_copy(item)),
                self._event("response.content_part.added", item_id=item["id"],
                            output_index=index, content_index=0, part=part)]

    def _close(self, status: Status = "completed") -> list[Json]:
        current, self._open = self._open, None
        if current is None:
            return []
        item, index, text = current.item, current.index, current.text
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if current.kind == "content":
            part: Json = {"type": "output_text", "text": text, "annotations": [],
                          "logprobs": current.logprobs}
            done = self._event("response.output_text.done", text=text,
                               logprobs=current.logprobs, **ids)
        else:
            part = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", text=text, **ids)
        item.update(content=[part], status=status)
        return [done, self._event("response.content_part.done", part=dict(part), **ids),
                self._event("response.output_item.done", output_index=index,
                            item=_copy(item))]

    def _event(self, kind: str, **fields: Any) -> Json:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _copy(item: Json) -> Json:
    return {**item, "content": [dict(p) for p in item.get("content", [])]} \
        if "content" in item else dict(item)


def usage_of(finished: Finished, reasoning_tokens: int) -> Json:
    """The Responses API's usage (input and output, not prompt and completion)."""
    return {"input_tokens": finished.prompt_tokens,
            "input_tokens_details": {"cached_tokens": finished.cached_tokens or 0},
            "output_tokens": finished.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": finished.prompt_tokens + finished.completion_tokens}
