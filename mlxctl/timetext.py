"""Times for a person: how long (``duration``: ``1m05s``) and when (``since``: its time
of day and how long ago). Below ``render.py`` and ``drain_view.py``, which both say them."""

from __future__ import annotations

import time


def duration(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def since(ts: float | None, now: float) -> str:
    """A transition's time: its time of day, and how long ago."""
    if ts is None:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f" ({duration(now - ts)} ago)"
