"""Stop strings, applied above the engine to the decoded text (sans-IO).

Text arrives in pieces, one per token; a stop string may span several. The
matcher lets out the text that can no longer be the start of a stop string,
holds back the rest, and cuts the output before the first (leftmost) stop
string found. Held text is always a proper prefix of some stop string, so an
occurrence that reaches into new text can only start inside what is held:
searching held + new is enough.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the leftmost; the first given)

    def feed(self, text: str) -> str:
        """Take the next piece of text; return what may be shown now. Once a stop
        string is found, ``stopped`` is true and everything after it is dropped."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        found = [(i, n) for n, s in enumerate(self._stops) if (i := buffer.find(s)) >= 0]
        if found:
            cut, which = min(found)
            self.stopped = True
            self.matched = self._stops[which]
            self._held = ""
            return buffer[:cut]
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The sequence ended without a stop string: the held text is output after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, buffer: str) -> int:
        """The length of the longest end of ``buffer`` that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
