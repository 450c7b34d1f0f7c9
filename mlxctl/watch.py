"""``mlxctl status --watch``: the status again every ``--interval`` seconds, like top.

On a terminal each snapshot is drawn over the last one (the cursor sent home, each line
cleared to its end, the rest of the screen cleared: no flicker), under a line saying
when it was taken; elsewhere each snapshot is printed after a ``--- HH:MM:SS ---``
separator, and with ``--json`` each is one ``mlxctl.status/1`` object on a line.

Every poll is one control request with a deadline (``MIN_DEADLINE_S``, 5 s, or the
interval if longer; the status itself waits at most 0.5 s for a worker's stats), so a
daemon that stops answering (or stops)
cannot hang the view: it shows ``daemon not answering (since HH:MM:SS): WHY`` and
keeps asking at the same pace, and shows the status again once it answers. Ctrl-C
ends the view with exit 0.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TextIO

from mlxceld.control.clients.blocking import BlockingClient
from mlxceld.errors import ControlError
from mlxctl import render

DEFAULT_INTERVAL_S: Final = 2.0
MIN_DEADLINE_S: Final = 5.0  # a poll's deadline: this, or the interval if longer
HOME, CLEAR_LINE, CLEAR_BELOW = "\033[H", "\033[K", "\033[J"


class Screen:
    """Where snapshots go: over each other on a terminal, one after another elsewhere."""

    def __init__(self, out: TextIO, terminal: bool, as_json: bool) -> None:
        self.out, self.terminal, self.as_json = out, terminal and not as_json, as_json
        if self.terminal:
            self.out.write("\033[2J")  # a clean screen once; redraws then overwrite it

    def show(self, when: float, interval: float, body: dict[str, Any] | None,
             down: str) -> None:
        """One snapshot: the status ``body``, or ``down`` (the daemon does not answer)."""
        stamp = time.strftime("%H:%M:%S", time.localtime(when))
        if self.as_json:
            obj = ({**body, "schema": "mlxctl.status/1"} if body is not None else
                   {"schema": "mlxctl.error/1", "error": {"code": "not_answering",
                                                          "message": down, "hint": ""}})
            self.out.write(json.dumps(obj) + "\n")
        else:
            text = render.status(body) if body is not None else down
            if self.terminal:
                head = f"every {interval:g} s, {stamp} (Ctrl-C ends)"
                lines = [head, "", *text.splitlines()]
                self.out.write(HOME + "".join(line + CLEAR_LINE + "\n" for line in lines)
                               + CLEAR_BELOW)
            else:
                self.out.write(f"--- {stamp} ---\n{text}\n")
        self.out.flush()


def watch(path: Path, interval: float, as_json: bool, out: TextIO = sys.stdout,
          clock: Callable[[], float] = time.monotonic) -> int:
    """Show the status every ``interval`` seconds until Ctrl-C (exit 0)."""
    screen = Screen(out, out.isatty(), as_json)
    down_since: float | None = None
    try:
        while True:
            started, asked = clock(), time.time()
            body: dict[str, Any] | None = None
            why = ""
            try:
                with BlockingClient(path, max(MIN_DEADLINE_S, interval)) as client:
                    body = client.status()
                down_since = None
            except ControlError as exc:
                down_since = down_since or asked
                why = exc.message
            since = time.strftime("%H:%M:%S", time.localtime(down_since or time.time()))
            screen.show(time.time(), interval, body,
                        f"daemon not answering (since {since}): {why}; still trying")
            time.sleep(max(0.0, interval - (clock() - started)))
    except KeyboardInterrupt:
        if screen.terminal:
            out.write("\n")
            out.flush()
        return 0
