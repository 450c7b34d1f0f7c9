"""The drains in force as ``mlxctl status`` shows them: one line each, under the
coordinator's cluster view (``render.pipeline``) or, on a node without one, after its
workers (``render.status``). ``mlxctl drain``'s own answer is ``drain.describe``."""

from __future__ import annotations

import time
from typing import Any

from mlxctl.timetext import duration, since


def drain_lines(drains: list[dict[str, Any]], now: float | None = None) -> list[str]:
    """The drains in force on a node with no cluster view (``mlxctl.status/1``'s
    ``drains``): a blank line, then one line each."""
    now = time.time() if now is None else now
    return ["", *(drain_line(d, now) for d in drains)] if drains else []


def drain_line(d: dict[str, Any], now: float) -> str:
    """One drain in force, as ``GET /v1/drains`` has it."""
    deadline = ("no deadline" if d.get("deadline") is None else
                "deadline passed" if d["deadline"] <= now else
                f"deadline in {duration(d['deadline'] - now)}")
    senders = "".join(f"; {s.get('sequences')} from {s.get('sender')}"
                      for s in d.get("senders") or [] if isinstance(s, dict))
    return (f"drain: node {d['node_id']} {d['state']} since {since(d['started_at'], now)}, "
            f"{deadline}: {d.get('finished', 0)} finished, {d.get('ended', 0)} ended"
            f"{senders}")
