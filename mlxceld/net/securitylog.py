"""Rate-limited security warnings: a flood of junk must not drown the log.

Warnings are limited per class: at most ``PER_WINDOW`` (5) in any sliding
``WINDOW_S`` (60 s) per class. The rest are counted, never written one by one
(not even at debug: a flood of 300,000 refused sockets is a count, not 300,000
lines). The next warning of that class written carries a summary of what was
suppressed since the last one (how many, of which kinds); ``flush`` writes the
summaries still pending as lines of their own (a listener calls it every window
and when it closes), so a flood that stops is still reported with its counts.
A flood thus writes at most ``PER_WINDOW`` warnings and one summary per class and
window. Classes:

- ``noise``: junk connections, pool refusals and evictions, silent sockets
- ``diagnostic``: typed refusals and authentication failures
- ``capacity``: at-capacity verdicts
- ``router_drop``: the router dropping a connection (no caller warns in it today)

``admit`` is pure (time comes in as ``now``); ``warn`` is the thin shell that
reads the monotonic clock and logs through this module's logger. A message is
a %-style template plus arguments; a summary counts it by its ``kind`` (the
template when none is given), so never put a secret or a payload in either.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

SecurityClass = Literal["noise", "diagnostic", "capacity", "router_drop"]
CLASSES: tuple[SecurityClass, ...] = ("noise", "diagnostic", "capacity", "router_drop")
PER_WINDOW = 5
WINDOW_S = 60.0


@dataclass(frozen=True)
class Verdict:
    """Write at warning (with ``summary`` appended, if any), or demote to debug."""

    warn: bool
    suppressed: int = 0  # how many of this class were demoted since the last warning
    summary: str = ""


@dataclass
class _ClassState:
    written: deque[float] = field(default_factory=deque)  # times of the warnings written
    suppressed: Counter[str] = field(default_factory=Counter)  # template -> count
    suppressed_since: float | None = None


class SecurityLog:
    def __init__(self, per_window: int = PER_WINDOW, window_s: float = WINDOW_S,
                 logger: logging.Logger = log) -> None:
        self.per_window = per_window
        self.window_s = window_s
        self._log = logger
        self._classes = {c: _ClassState() for c in CLASSES}

    def admit(self, cls: SecurityClass, now: float, kind: str = "") -> Verdict:
        """Decide one warning of ``cls`` at ``now``; ``kind`` is what a summary counts it as."""
        state = self._classes[cls]
        while state.written and now - state.written[0] >= self.window_s:
            state.written.popleft()
        if len(state.written) >= self.per_window:
            if state.suppressed_since is None:
                state.suppressed_since = now
            state.suppressed[kind or cls] += 1
            return Verdict(False)
        state.written.append(now)
        count, summary = self._take_summary(cls, now)
        return Verdict(True, count, summary)

    def warn(self, cls: SecurityClass, msg: str, *args: object, now: float | None = None,
             kind: str = "") -> None:
        """Log ``msg % args`` at warning if ``cls`` has room, else count it as ``kind``
        (default: ``msg``) for the next summary."""
        verdict = self.admit(cls, time.monotonic() if now is None else now, kind or msg)
        if not verdict.warn:
            return
        if verdict.summary:
            self._log.warning("[%s] " + msg + "; %s", cls, *args, verdict.summary)
        else:
            self._log.warning("[%s] " + msg, cls, *args)

    def flush(self, prefix: str = "", now: float | None = None) -> None:
        """Write each class's pending summary (if any) as a warning of its own;
        ``prefix`` names the writer ("agent listener: ")."""
        when = time.monotonic() if now is None else now
        for cls in CLASSES:
            count, summary = self._take_summary(cls, when)
            if count:
                self._log.warning("[%s] %s%s", cls, prefix, summary)

    def _take_summary(self, cls: SecurityClass, now: float) -> tuple[int, str]:
        """(how many, a sentence with the counts by kind) suppressed in ``cls`` since the
        last summary, and forget them; (0, "") if none."""
        state = self._classes[cls]
        if not state.suppressed:
            return 0, ""
        count = sum(state.suppressed.values())
        kinds = ", ".join(f"{n} x {k}" for k, n in state.suppressed.most_common())
        since = now - (state.suppressed_since if state.suppressed_since is not None else now)
        summary = (f"{count} more {cls} warning(s) suppressed in the last {since:.0f} s "
                   f"({kinds})")
        state.suppressed.clear()
        state.suppressed_since = None
        return count, summary
