"""Logging a burst of like events once: the first at once, then one count per window.

A flood (thousands of connections closed at their deadline, ``accept()`` failing
with "Too many open files" a thousand times a second) must not flood the log and
rotate the useful lines away. ``Burst.note`` logs the first event of a kind; the
next ones within ``every_s`` are only counted, and the count is logged once when
the window closes (``... and 2,117 more in the last 60 s``). A burst of any size
is so at most two lines a window.
"""

from __future__ import annotations

import asyncio
import logging
import time

EVERY_S = 60.0  # one line per kind of event and per minute at most, plus the count


class Burst:
    """One kind of event (``what``, e.g. "connections closed at the header deadline")."""

    def __init__(self, logger: logging.Logger, level: int, what: str,
                 every_s: float = EVERY_S) -> None:
        self._logger, self._level, self._what, self._every_s = logger, level, what, every_s
        self._window_end = 0.0
        self._counted = 0
        self._flush: asyncio.TimerHandle | None = None

    def note(self, message: str, *args: object) -> None:
        """Log ``message`` if no event of this kind was logged in the window; else count it.
        Called on an event loop, which logs the count when the window closes."""
        now = time.monotonic()
        if now >= self._window_end:
            self.flush()
            self._logger.log(self._level, message, *args)
            self._window_end = now + self._every_s
            return
        self._counted += 1
        if self._flush is None:
            loop = asyncio.get_running_loop()
            self._flush = loop.call_at(loop.time() + self._window_end - now, self.flush)

    def flush(self) -> None:
        """Log the count of the events not logged, if any."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._counted:
            self._logger.log(self._level, "... and %d more %s in the last %.0f s", self._counted,
                             self._what, self._every_s)
            self._counted = 0
