"""How far each peer's stage has loaded, as `mlxctl cluster activate` shows it.

On a terminal, a rich progress bar per loading peer (rich comes with typer),
with the bring-up's steps printed above the bars; elsewhere (a pipe, a log),
one line per tenth of each peer's load, beside the steps. Fed from the
bring-up rows the command polls (``loading``: done, total, elapsed_s, and step: a stage
of a repo id's model downloads its shards, then loads them, each with its own tenths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn

from mlxctl import render


class LoadView:
    """Steps and loads of one bring-up; ``console`` None: lines through ``echo``."""

    def __init__(self, echo: Callable[[str], None], console: Console | None = None) -> None:
        self._echo = echo
        self._tenths: dict[tuple[str, str], int] = {}  # the last tenth printed, per peer, step
        self._tasks: dict[str, TaskID] = {}  # the bar of each peer (terminal)
        self._bars: Progress | None = None
        if console is not None:
            self._bars = Progress(TextColumn("{task.description}"), BarColumn(),
                                  TextColumn("{task.percentage:>3.0f}%"), DownloadColumn(),
                                  console=console, transient=True)
            self._bars.start()

    def step(self, line: str) -> None:
        """A bring-up step: above the bars, or a line."""
        if self._bars is not None:
            self._bars.console.print(line, markup=False, highlight=False)
        else:
            self._echo(line)

    def peer(self, row: dict[str, Any]) -> None:
        """A peer's row as polled: its load, if it is loading and has said how far."""
        load = render.peer_loading(row)
        if load is None:
            return
        address = row["address"]
        step = str(row["loading"].get("step") or "loading")  # downloading, then loading
        if self._bars is None:
            if load[0] // 10 > self._tenths.get((address, step), -1):
                self._tenths[(address, step)] = load[0] // 10
                self._echo(load[1])
            return
        done, total = int(row["loading"]["done"]), int(row["loading"]["total"])
        name = f"{row.get('stage') or '-'} {address}" + (f" ({step})" if step != "loading"
                                                           else "")
        task = self._tasks.get(address)
        if task is None:
            self._tasks[address] = self._bars.add_task(name, total=total, completed=done)
        else:
            self._bars.update(task, total=total, completed=done, description=name)

    def close(self) -> None:
        if self._bars is not None:
            self._bars.stop()
