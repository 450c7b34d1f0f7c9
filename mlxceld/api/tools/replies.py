"""A chat answer's text split into its parts: content, reasoning and tool calls (sans-IO).

Text arrives in pieces, as the decoder lets it out (after the stop strings). The model's
markers (``codec.ChatFeatures``) switch between three states:

- content, until a tool call's start marker (when the request offered tools) or a
  reasoning start marker;
- reasoning, until the reasoning end marker; an answer starts in it when its prompt ended
  inside a reasoning block (``TextCodec.opens_thinking``);
- a tool call, until its end marker: the text between is one ``CallText``, parsed above
  (``tools/calls.py``).

The whitespace that follows a reasoning block's end (templates write ``</think>\n\n``) is
not content: content starts at its first other character.

Markers are matched in the text, so a marker split across pieces (or spelled by several
tokens) is found: text that may be the start of a marker is held back until the next
piece says whether it is one, as ``StopMatcher`` does. Markers are never shown. A tool
call still open when the answer ends is shown as content, its start marker included
(``finish``), so that no text is lost.

``ChatReply`` puts the splitter and the tool-call reader together: ``Said`` parts and
``Called`` calls out, a call the reader cannot read shown as content, markers and all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from mlxceld.api.codec import ChatFeatures
from mlxceld.api.tools.calls import ToolCall

PartKind = Literal["content", "reasoning"]


@dataclass(frozen=True)
class Said:
    """Text to show: the answer's ``content`` or its ``reasoning_content``."""

    kind: PartKind
    text: str


@dataclass(frozen=True)
class CallText:
    """The text of one complete tool call, without its markers."""

    text: str


Part = Said | CallText
State = Literal["content", "reasoning", "call"]


class ReplySplitter:
    """``tools``: whether tool-call markers count (the request offered tools);
    ``thinking``: whether the answer starts as reasoning; ``max_calls``: after that many
    complete calls ``done`` is set (``parallel_tool_calls`` false: 1), None: no limit."""

    def __init__(self, features: ChatFeatures, *, tools: bool, thinking: bool,
                 max_calls: int | None = None) -> None:
        self._call_markers = features.tool_call if tools else None
        self._think = features.think
        self._state: State = "reasoning" if thinking and self._think else "content"
        self._held = ""
        self._call = ""
        self._max_calls = max_calls
        self._trim = False  # reasoning just ended: the whitespace after it is not content
        self._fed = 0  # the characters fed so far
        # Where the reasoning lies in the text fed: [start, end) each, the last one's end
        # None while it is open.
        self.reasoning: list[tuple[int, int | None]] = \
            [(0, None)] if self._state == "reasoning" else []
        self.starts_reasoning = self._state == "reasoning"
        self.calls = 0
        self.done = False

    def feed(self, text: str) -> list[Part]:
        """Take the next piece; return the parts it completes, in order."""
        parts: list[Part] = []
        buffer = self._held + text
        at_buffer = self._fed - len(self._held)  # where ``buffer`` starts in the text fed
        self._fed += len(text)
        self._held = ""
        while buffer and not self.done:
            markers = self._markers()
            found = [(i, m, s) for m, s in markers if (i := buffer.find(m)) >= 0]
            if not found:
                keep = _partial_suffix(buffer, [m for m, _ in markers])
                self._emit(buffer[: len(buffer) - keep], parts)
                self._held = buffer[len(buffer) - keep:]
                break
            at, marker, state = min(found)
            self._emit(buffer[:at], parts)
            if state == "reasoning":
                self.reasoning.append((at_buffer + at + len(marker), None))
            elif self._state == "reasoning":
                self.reasoning[-1] = (self.reasoning[-1][0], at_buffer + at)
            buffer = buffer[at + len(marker):]
            at_buffer += at + len(marker)
            self._switch(state, parts)
        return parts

    def finish(self) -> list[Part]:
        """The answer ended: what was held back, and an unfinished call as content."""
        parts: list[Part] = []
        held, self._held = self._held, ""
        if self.done:
            return parts
        if self._state == "call":
            start = self._call_markers[0] if self._call_markers else ""
            parts.append(Said("content", start + self._call + held))
            self._call = ""
            self._state = "content"
        else:
            self._emit(held, parts)
        return parts

    @property
    def open_call(self) -> bool:
        """Whether a tool call has started and not ended."""
        return self._state == "call"

    def _markers(self) -> list[tuple[str, State]]:
        if self._state == "reasoning":
            return [(self._think[1], "content")] if self._think else []
        if self._state == "call":
            return [(self._call_markers[1], "content")] if self._call_markers else []
        markers: list[tuple[str, State]] = []
        if self._call_markers:
            markers.append((self._call_markers[0], "call"))
        if self._think:
            markers.append((self._think[0], "reasoning"))
        return markers

    def _emit(self, text: str, parts: list[Part]) -> None:
        if self._trim and self._state == "content":
            text = text.lstrip()
            self._trim = not text
        if not text:
            return
        if self._state == "call":
            self._call += text
        else:
            parts.append(Said(self._state, text))

    def _switch(self, state: State, parts: list[Part]) -> None:
        if self._state == "call":
            parts.append(CallText(self._call))
            self._call = ""
            self.calls += 1
            if self._max_calls is not None and self.calls >= self._max_calls:
                self.done = True
        self._trim = self._state == "reasoning" and state == "content"
        self._state = state


def _partial_suffix(buffer: str, markers: list[str]) -> int:
    """The length of the longest end of ``buffer`` that begins some marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:size]):
                longest = size
                break
    return longest


@dataclass(frozen=True)
class Called:
    """The calls one tool-call block held (most parsers give one)."""

    calls: tuple[ToolCall, ...]


Reading = Said | Called


class ChatReply:
    """One chat answer read as it arrives. ``read_calls``: a call's text to its calls,
    None when it cannot be read (``toolcalls.parse_calls``)."""

    def __init__(self, splitter: ReplySplitter, features: ChatFeatures,
                 read_calls: Callable[[str], list[ToolCall] | None]) -> None:
        self._splitter = splitter
        self._markers = features.tool_call or ("", "")
        self._read = read_calls
        self.called = False  # whether any call was read

    @property
    def done(self) -> bool:
        """Whether the answer is complete (its one allowed call made): end the sequence."""
        return self._splitter.done

    @property
    def starts_reasoning(self) -> bool:
        """Whether the answer starts as reasoning (its prompt opened the reasoning)."""
        return self._splitter.starts_reasoning

    @property
    def reasoning(self) -> list[tuple[int, int | None]]:
        """Where the reasoning lies in the text fed: ``[start, end)`` each (None: to the
        end)."""
        return self._splitter.reasoning

    def feed(self, text: str) -> list[Reading]:
        return self._readings(self._splitter.feed(text))

    def finish(self) -> list[Reading]:
        return self._readings(self._splitter.finish())

    def _readings(self, parts: list[Part]) -> list[Reading]:
        out: list[Reading] = []
        for part in parts:
            if isinstance(part, Said):
                out.append(part)
                continue
            calls = self._read(part.text)
            if calls is None:
                out.append(Said("content", self._markers[0] + part.text + self._markers[1]))
            else:
                self.called = True
                out.append(Called(tuple(calls)))
        return out


class TokenPlaces:
    """Where each generated token's text lies in an answer's text, to count the tokens by
    the part they made (``reasoning_tokens``: those inside the reasoning, its markers
    not). A token whose text is held back (an unfinished character, a lone space) takes
    its place where its text starts."""

    def __init__(self) -> None:
        self._places: list[tuple[int, int]] = []
        self._at = 0

    def add(self, made: str) -> None:
        """The next token made ``made`` (the decoder's text, before the stop strings)."""
        self._places.append((self._at, self._at + len(made)))
        self._at += len(made)

    def within(self, spans: list[tuple[int, int | None]]) -> int:
        """How many tokens lie wholly inside ``spans`` (``[start, end)``; end None: to the
        end of the text); a token with no text, where its place is."""
        count = 0
        for start, end in spans:
            stop = self._at + 1 if end is None else end
            count += sum(1 for a, b in self._places
                         if start <= a and (b <= stop if b > a else a < stop))
        return count
