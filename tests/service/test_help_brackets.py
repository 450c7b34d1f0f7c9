"""Every `--help` of `mlxceld` and `mlxctl` shows the bracketed words its source writes
(``[serve]``, ``[v6]``, ``[cluster] secret_file``): rich markup, which would take them for
style tags and drop them, is off on every typer app."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from mlxceld.cli import app as daemon_app
from mlxctl.app import app as ctl_app

BRACKETED = re.compile(r"\[[^\]\s]+\]")  # what rich reads as a tag: [serve], [v6], [/x]


def commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command under ``group`` (itself included), with the words that reach it
    (typer's own copy of click: its classes, not click's)."""
    yield path, group
    if hasattr(group, "commands"):
        for name, sub in group.commands.items():
            yield from commands(sub, (*path, name))


def written(command: Any) -> set[str]:
    """The bracketed words of a command's help, epilog and options' help, as written."""
    texts = [command.help or "", command.epilog or ""]
    texts += [getattr(p, "help", None) or "" for p in command.params]
    return {m for text in texts for m in BRACKETED.findall(text)}


def shown(app: typer.Typer, args: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], terminal_width=200,
                                env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


CASES = [(app, path, command) for app in (daemon_app, ctl_app)
         for path, command in commands(typer.main.get_command(app))]


def test_the_source_has_bracketed_words_to_show() -> None:
    found = set().union(*(written(c) for _, _, c in CASES))
    assert {"[serve]", "[v6]"} <= found  # the test sees what it is about


@pytest.mark.parametrize(("app", "path", "command"), CASES,
                         ids=[" ".join(("mlxceld" if a is daemon_app else "mlxctl", *p))
                              for a, p, _ in CASES])
def test_every_bracketed_word_is_shown(app: typer.Typer, path: tuple[str, ...],
                                       command: Any) -> None:
    if not command.add_help_option:
        pytest.skip("passes --help on to its own parser (mlxctl model fixture)")
    out = shown(app, path)
    missing = sorted(w for w in written(command) if w not in out)
    assert not missing, f"{' '.join(path) or 'top'} --help drops {missing}:\n{out}"


@pytest.mark.parametrize("argv", [["mlxceld", "--help"], ["mlxctl", "unserve", "--help"]])
def test_the_real_entry_points_too(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "200"},
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())
    if argv[0] == "mlxceld":
        assert "([v6]:port for IPv6)" in out and "[serve] model" in out
    else:
        assert "from --model or [serve] model" in out
