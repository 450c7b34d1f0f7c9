"""What the tests of tensor groups and meshes across daemons ask of a daemon: a worker
while it runs, and the router's greedy completion of ``PROMPT``."""

from __future__ import annotations

from typing import Any

from helpers.daemons import DaemonProc
from helpers.models import PROMPT
from helpers.router import client


def running_worker(d: DaemonProc, name: str) -> dict[str, Any] | None:
    """``name`` on ``d`` while it runs, else None."""
    w = next((w for w in d.status()["workers"] if w["name"] == name), None)
    return w if w is not None and w["state"] == "running" else None


def complete(port: int) -> str:
    """Eight greedy tokens of ``PROMPT`` through the `openai` client on ``port``."""
    with client(f"http://127.0.0.1:{port}/v1") as c:
        text: str = c.completions.create(model="llama", prompt=PROMPT, max_tokens=8,
                                         temperature=0).choices[0].text
        return text
