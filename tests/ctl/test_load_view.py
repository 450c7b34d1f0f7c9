"""`mlxctl cluster activate`'s view of the peers' loads (``mlxctl/progress.py``): a line per
tenth off a terminal, a rich bar per loading peer on one, the steps above the bars."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from mlxctl.progress import LoadView


def row(done: int, total: int = 10 << 20, state: str = "loading") -> dict[str, Any]:
    return {"stage": "stage-1", "address": "127.0.0.2:7000", "layers": [2, 4], "state": state,
            "reason": "", "loading": {"done": done, "total": total, "elapsed_s": 3.0}}


def test_off_a_terminal_a_line_per_tenth() -> None:
    lines: list[str] = []
    view = LoadView(lines.append)
    view.step("a step")
    for done in (0, 1 << 20, (1 << 20) + 5, 5 << 20, 10 << 20):
        view.peer(row(done))
    view.peer(row(0, state="prepared"))
    view.close()
    assert lines[0] == "a step"
    assert [line.split("loading ")[1].split("%")[0] for line in lines[1:]] == [
        "0", "10", "50", "100"]


def test_on_a_terminal_a_bar_per_peer() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    lines: list[str] = []
    view = LoadView(lines.append, console)
    view.peer(row(0))
    view.step("stage-0 127.0.0.3:7000 prepared")
    view.peer(row(4 << 20))
    view.peer({**row(0), "address": "127.0.0.3:7000", "loading": None})  # has not said
    view.close()
    assert lines == []  # everything went to the console
    shown = out.getvalue()
    assert "stage-0 127.0.0.3:7000 prepared" in shown
    assert "stage-1 127.0.0.2:7000" in shown and "40%" in shown
    assert "100%" not in shown


def test_on_a_terminal_a_bar_is_full_once_its_peer_has_loaded() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    view = LoadView(print, console)
    view.peer(row(4 << 20))
    view.peer({**row(0, state="prepared"), "loading": None})
    view.close()
    assert "100%" in out.getvalue().split("40%")[-1]


def test_a_download_then_its_load_each_have_their_tenths() -> None:
    """A stage of a repo id's model fetches its shards first (step ``downloading``)."""
    lines: list[str] = []
    view = LoadView(lines.append)
    for step in ("downloading", "loading"):
        for done in (0, 10 << 20):
            r = row(done)
            r["loading"]["step"] = step
            view.peer(r)
    view.close()
    assert [" ".join(line.split(" of ")[0].split()[-2:]) for line in lines] == [
        "downloading 0%", "downloading 100%", "loading 0%", "loading 100%"]
