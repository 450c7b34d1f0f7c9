"""Tokens per second from a running count, sampled now and then; time is an input.

The router samples its pipeline engine's count of tokens generated (``PipelineEngine.
tokens``: every token read from the last stage and handed to a request, end-of-sequence
tokens included) every ``workers.router.STATS_EVERY_S`` and reports the rate over the
last ``WINDOW_S`` in its stats (``tokens_per_s``: the pipeline's, as its clients get
them; ``mlxctl status`` shows it).
"""

from __future__ import annotations

from collections import deque
from typing import Final

WINDOW_S: Final = 10.0


class Throughput:
    """The rate of a growing count over the last ``window_s`` of samples."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be above 0, not {window_s!r}")
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def sample(self, count: int, now: float) -> None:
        """The count at ``now`` (a monotonic clock); samples older than the window go,
        but for the one the window starts from."""
        self._samples.append((now, count))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        """Per second between the window's first sample and its last; None until two
        samples lie apart (0.0 while the count stands still)."""
        if len(self._samples) < 2:
            return None
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None
