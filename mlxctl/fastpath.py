"""The fast path: ``status``, ``workers`` and ``logs`` without importing typer.

Building typer's command tree (typer, click, pydantic for its parameter coercion, and
every command module) cost each ``mlxctl status`` most of its time, for three commands
whose arguments are a handful of flags. ``parse`` takes an argument list only when its
meaning is plain: the global ``--socket``, the command, that command's own options once
each, and one WORKER for ``logs``::

    [--socket PATH] status|workers [--socket PATH] [--json]
    [--socket PATH] logs WORKER [-f|--follow] [-n|--lines N] [--socket PATH] [--json]

(options in any order, ``--opt=VALUE`` too). Anything else returns None and typer
parses it as it always has: help, completion, a usage error, other spellings (``-fn5``,
``--``, a repeated option). The fast path never decides an error, so typer's messages
and exit codes stay the only ones.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mlxctl.edge import EXIT_FAILURE, EXIT_INTERRUPTED

SOCKET_ENV = "MLXCELD_SOCKET"
MAX_LOG_LINES = 10_000  # as `mlxctl logs --lines` declares it
_LINES = re.compile(r"0|[1-9][0-9]{0,4}")

# option spelling -> (name, takes a value)
_COMMON = {"--socket": ("socket", True), "--json": ("json", False)}
_OPTIONS: dict[str, dict[str, tuple[str, bool]]] = {
    "status": _COMMON,
    "workers": _COMMON,
    "logs": {**_COMMON, "--follow": ("follow", False), "-f": ("follow", False),
             "--lines": ("lines", True), "-n": ("lines", True)},
}
_ARGUMENTS = {"status": 0, "workers": 0, "logs": 1}


@dataclass(frozen=True)
class Invocation:
    """One plain ``status``, ``workers`` or ``logs`` command line, with its defaults."""

    command: str
    socket: Path | None  # None: the default lookup (mlxceld.paths.client_socket)
    as_json: bool = False
    worker: str = ""
    follow: bool = False
    lines: int = 50


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> Invocation | None:
    """The invocation ``argv`` means, or None when typer should parse it."""
    if any(k == "_TYPER_COMPLETE_ARGS" or (k.startswith("_") and k.endswith("_COMPLETE"))
           for k in environ):
        return None  # a shell asks typer for completions
    before: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        taken = _option(argv, i, {"--socket": ("socket", True)}, before)
        if taken is None:
            return None
        i = taken
    if i >= len(argv) or argv[i] not in _OPTIONS:
        return None
    command, spec = argv[i], _OPTIONS[argv[i]]
    given: dict[str, str] = {}
    arguments: list[str] = []
    i += 1
    while i < len(argv):
        if argv[i].startswith("-"):
            taken = _option(argv, i, spec, given)
            if taken is None:
                return None
            i = taken
        else:
            arguments.append(argv[i])
            i += 1
    if len(arguments) != _ARGUMENTS[command] or "" in arguments:
        return None
    lines = given.get("lines", "50")
    if not _LINES.fullmatch(lines) or int(lines) > MAX_LOG_LINES:
        return None
    # As options.socket_path resolves it: the command's --socket, else the one given
    # before the command, else the variable.
    env = environ.get(SOCKET_ENV) or None
    socket = given.get("socket") or before.get("socket") or env
    return Invocation(command, Path(socket) if socket else None, as_json="json" in given,
                      worker=arguments[0] if arguments else "", follow="follow" in given,
                      lines=int(lines))


def _option(argv: Sequence[str], i: int, spec: Mapping[str, tuple[str, bool]],
            given: dict[str, str]) -> int | None:
    """Take the option at ``argv[i]`` into ``given``; the index after it, or None if it is
    not one of ``spec``, is repeated, or its value is missing or looks like an option."""
    spelling, eq, value = argv[i].partition("=")
    if spelling not in spec or (eq and not spelling.startswith("--")):
        return None
    name, takes_value = spec[spelling]
    if name in given or (eq and not takes_value):
        return None
    if takes_value and not eq:
        if i + 1 >= len(argv):
            return None
        i += 1
        value = argv[i]
    if takes_value and (not value or value.startswith("-")):
        return None
    given[name] = value
    return i + 1


def streams_are_plain() -> bool:
    """True when stdout and stderr take any text (click rewraps an ASCII stream)."""
    return all(_encodes_unicode(s) for s in (sys.stdout, sys.stderr))


def _encodes_unicode(stream: TextIO | None) -> bool:
    encoding = getattr(stream, "encoding", None)
    if not encoding:
        return False
    try:
        return codecs.lookup(encoding).name != "ascii"
    except LookupError:
        return False


def run(invocation: Invocation) -> None:
    """Run it as the typer command would, with typer's exits for ^C and a closed pipe."""
    from mlxceld.paths import client_socket
    from mlxctl import reading

    path = invocation.socket or client_socket()
    try:
        if invocation.command == "status":
            reading.status(path, invocation.as_json)
        elif invocation.command == "workers":
            reading.workers(path, invocation.as_json)
        else:
            reading.logs(path, invocation.worker, invocation.lines, invocation.follow,
                         invocation.as_json)
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:
        # The reader went away (`mlxctl logs x | head`): exit 1 quietly, as click does,
        # with stdout pointed at /dev/null so the interpreter's last flush cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(EXIT_FAILURE) from None
