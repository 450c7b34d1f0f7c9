"""mlxctl's fast path against typer itself: every argument list it takes, typer parses to
the same command and values; every one typer refuses, it leaves to typer. And its colours
are typer's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import typer

from mlxceld.paths import client_socket
from mlxctl import reading, render
from mlxctl.app import app
from mlxctl.fastpath import Invocation, parse

ENV = "MLXCELD_SOCKET"

# (argv, what the fast path must make of it: an Invocation, or None to leave it to typer)
TAKEN: list[tuple[list[str], Invocation]] = [
    (["status"], Invocation("status", None)),
    (["status", "--json"], Invocation("status", None, as_json=True)),
    (["--socket", "/a.sock", "status"], Invocation("status", Path("/a.sock"))),
    (["--socket=/a.sock", "workers", "--json"], Invocation("workers", Path("/a.sock"), True)),
    (["workers", "--socket", "b.sock"], Invocation("workers", Path("b.sock"))),
    (["--socket", "/a", "workers", "--socket=/b"], Invocation("workers", Path("/b"))),
    (["logs", "alpha"], Invocation("logs", None, worker="alpha")),
    (["logs", "-f", "alpha", "-n", "0"], Invocation("logs", None, worker="alpha",
                                                    follow=True, lines=0)),
    (["logs", "--lines=10000", "--follow", "--json", "beta"],
     Invocation("logs", None, True, "beta", True, 10000)),
    (["logs", "--lines", "7", "x", "--socket", "/s"], Invocation("logs", Path("/s"),
                                                                 worker="x", lines=7)),
]
# Typer's to parse: help, other commands, and spellings the fast path does not take
# (typer accepts each of these, its own way).
LEFT = [[], ["--help"], ["status", "-h"], ["logs", "x", "--help"], ["version"], ["events"],
        ["secret", "list"], ["--install-completion"], ["--show-completion", "bash"],
        ["logs", "a", "-n5"], ["logs", "a", "-fn", "5"], ["logs", "a", "-n", "05"],
        ["logs", "a", "-n", "+5"], ["logs", "a", "-n", "1_0"], ["logs", "--", "-a"],
        ["logs", "-"], ["logs", ""], ["status", "--json", "--json"], ["status", "--socket="],
        ["status", "--socket", "--json"], ["--socket", "a", "--socket", "b", "status"]]
# Usage errors: typer's to report (exit 2).
WRONG = [["stat"], ["status", "extra"], ["logs"], ["logs", "a", "b"],
         ["logs", "a", "-n", "10001"], ["logs", "a", "-n", "-1"], ["logs", "a", "-n", "x"],
         ["logs", "a", "-n"], ["status", "--json=1"], ["status", "--socket"],
         ["--json", "status"], ["status", "--sock", "/a"], ["-f", "logs", "a"],
         ["status", "-f"], ["workers", "-n", "5"]]


@pytest.fixture
def typer_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...]]]:
    """What typer's commands hand to the command bodies (recorded instead of run)."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    for name in ("status", "workers", "logs"):
        monkeypatch.setattr(reading, name,
                            lambda *args, name=name: calls.append((name, args)))
    return calls


def fast_call(invocation: Invocation) -> tuple[str, tuple[Any, ...]]:
    """The same, for the fast path (``fastpath.run`` hands these on)."""
    path = invocation.socket or client_socket()
    if invocation.command == "logs":
        return "logs", (path, invocation.worker, invocation.lines, invocation.follow,
                        invocation.as_json)
    return invocation.command, (path, invocation.as_json)


@pytest.mark.parametrize(("argv", "expected"), TAKEN, ids=lambda v: repr(v)[:60])
@pytest.mark.parametrize("env", [None, "/env.sock"])
def test_what_the_fast_path_takes_typer_means_the_same_way(
        argv: list[str], expected: Invocation, env: str | None,
        typer_calls: list[tuple[str, tuple[Any, ...]]], monkeypatch: pytest.MonkeyPatch) -> None:
    if env:
        monkeypatch.setenv(ENV, env)
    else:
        monkeypatch.delenv(ENV, raising=False)
    got = parse(argv, {ENV: env} if env else {})
    assert got is not None
    if env is None:
        assert got == expected
    else:  # a --socket anywhere wins; the variable stands in when there is none
        assert got == (expected if expected.socket
                        else dataclasses.replace(expected, socket=Path(env)))
    app(argv, prog_name="mlxctl", standalone_mode=False)
    assert typer_calls == [fast_call(got)]


@pytest.mark.parametrize("argv", LEFT + WRONG, ids=repr)
def test_the_rest_is_left_to_typer(argv: list[str]) -> None:
    assert parse(argv, {}) is None
    assert parse(argv, {ENV: "/env.sock"}) is None


@pytest.mark.parametrize("argv", WRONG, ids=repr)
def test_what_typer_refuses_is_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(Exception) as err:
        app(argv, prog_name="mlxctl", standalone_mode=False)
    assert getattr(err.value, "exit_code", None) == 2, err.value


@pytest.mark.parametrize("key", ["_MLXCTL_COMPLETE", "_TYPER_COMPLETE_ARGS",
                                 "_PYTHON__M_MLXCTL_COMPLETE"])
def test_a_completion_request_goes_to_typer(key: str) -> None:
    assert parse(["status"], {key: "complete_bash"}) is None
    assert parse(["status"], {ENV: ""}) == Invocation("status", None)  # empty: not given


@pytest.mark.parametrize("color", sorted(render.ANSI_COLORS))
@pytest.mark.parametrize("bold", [False, True])
def test_colours_are_typers(color: str, bold: bool) -> None:
    assert render.style("x", color, bold=bold) == typer.style("x", fg=color, bold=bold)
    assert render.style("x", None, bold=bold) == typer.style("x", bold=bold)
