"""How far a model load has come, as `mlxctl cluster activate` and `mlxctl serve` show it.

On a terminal, a rich progress bar per load (rich comes with typer): each peer's
stage in a bring-up, the router's model in `mlxctl serve`; the command's steps are
printed above the bars. Elsewhere (a pipe, a log), one line per tenth of each load,
beside the steps. Fed from what the commands poll: a bring-up's peer rows
(``peer``: their ``loading``, done, total, elapsed_s, and step: a stage of a repo
id's model downloads its shards, then loads them, each with its own tenths) or a
worker's stats (``load``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn

from mlxctl import render

LOADED = frozenset({"prepared", "committed", "active"})  # a peer's steps past its load


class LoadView:
    """Steps and loads of one command (a bring-up, a serve); ``console`` None: lines
    through ``echo``."""

    def __init__(self, echo: Callable[[str], None], console: Console | None = None) -> None:
        self._echo = echo
        self._shown: dict[str, int] = {}  # the steps printed, per peer
        self._tenths: dict[tuple[str, str], int] = {}  # the last tenth printed, per load, step
        self._tasks: dict[str, TaskID] = {}  # the bar of each load (terminal)
        self._totals: dict[str, int] = {}  # the bytes of each load, as its bar last heard
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

    def peers(self, rows: list[dict[str, Any]]) -> None:
        """A bring-up's peer rows as polled: each step not shown yet (a line; the reason
        with the last), then each peer's load."""
        for p in rows:
            steps = p.get("steps") or []
            for i in range(self._shown.get(p["address"], 0), len(steps)):
                last = i == len(steps) - 1
                self.step(render.peer_step({**p, "state": steps[i],
                                            "reason": p["reason"] if last else ""}))
            self._shown[p["address"]] = len(steps)
            self.peer(p)

    def peer(self, row: dict[str, Any]) -> None:
        """A peer's row as polled: its load, if it is loading and has said how far."""
        load = render.peer_loading(row)
        if load is None:
            task = self._tasks.get(row["address"])
            if task is not None and self._bars is not None and row.get("state") in LOADED:
                self._bars.update(task, completed=self._totals[row["address"]])
            return
        done, total = int(row["loading"]["done"]), int(row["loading"]["total"])
        step = str(row["loading"].get("step") or "loading")  # downloading, then loading
        label = f"{row.get('stage') or '-'} {row['address']}" + (
            f" ({step})" if step != "loading" else "")
        self.load(row["address"], label, done, total, load[1], step)

    def load(self, key: str, label: str, done: int, total: int, line: str,
             step: str = "loading") -> None:
        """One load (``key``: whose) at ``done`` of ``total`` bytes in its ``step``: its
        bar, labelled ``label``, or ``line`` when it has reached another tenth."""
        if self._bars is None:
            tenth = (100 * done // total if total > 0 else 0) // 10
            if tenth > self._tenths.get((key, step), -1):
                self._tenths[(key, step)] = tenth
                self._echo(line)
            return
        task = self._tasks.get(key)
        self._totals[key] = total
        if task is None:
            self._tasks[key] = self._bars.add_task(label, total=total, completed=done)
        else:
            self._bars.update(task, total=total, completed=done, description=label)

    def restart(self, key: str) -> None:
        """Load ``key`` begins again (a worker restarted): its lines from 0%, its bar too."""
        for seen in [k for k in self._tenths if k[0] == key]:
            del self._tenths[seen]
        task = self._tasks.get(key)
        if task is not None and self._bars is not None:
            self._bars.reset(task)

    def close(self) -> None:
        if self._bars is not None:
            self._bars.stop()
