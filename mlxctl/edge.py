"""mlxctl's edge: the one place a client job runs, text and JSON output, exit codes.

Exit codes: 0 ok, 1 failure, 2 usage, 3 daemon not running, 4 permission denied.

No typer and no asyncio here: the fast path (``mlxctl.fastpath``) runs ``status``,
``workers`` and ``logs`` through this module and ``call_blocking`` without importing
either. ``echo`` keeps click's contract for text (one line, flushed; ANSI codes stripped
unless the stream is a terminal), and ``fail`` exits with ``SystemExit``, which typer
passes through as it does its own ``Exit``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from mlxceld.control.clients.blocking import BlockingClient
from mlxceld.errors import ControlError, DaemonNotRunning, PermissionDenied

if TYPE_CHECKING:
    from mlxceld.control.clients.typed import ControlClient

EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_DENIED = 1, 2, 3, 4
EXIT_INTERRUPTED = 130
T = TypeVar("T")
_ANSI = re.compile(r"\033\[[;?0-9]*[a-zA-Z]")  # click's strip_ansi


def echo(text: str, *, err: bool = False) -> None:
    """Print one line, as ``typer.echo`` does."""
    stream = sys.stderr if err else sys.stdout
    if not _isatty(stream):
        text = _ANSI.sub("", text)
    stream.write(text + "\n")
    stream.flush()


def emit(as_json: bool, schema: str, body: dict[str, Any], text: Callable[[], str]) -> None:
    if as_json:
        echo(json.dumps({**body, "schema": f"mlxctl.{schema}/1"}, indent=2))
    else:
        echo(text())


def call(path: Path, as_json: bool, job: Callable[[ControlClient], Awaitable[T]]) -> T:
    """Run one client job at the CLI's edge; map our errors to exit codes and messages."""
    import asyncio

    from mlxceld.control.clients.typed import ControlClient

    async def go() -> T:
        async with ControlClient(path) as client:
            return await job(client)

    try:
        return asyncio.run(go())
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except ControlError as exc:
        refuse(as_json, exc)


def call_blocking(path: Path, as_json: bool, job: Callable[[BlockingClient], T]) -> T:
    """``call`` for a job of the blocking client (no asyncio)."""
    try:
        with BlockingClient(path) as client:
            return job(client)
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except ControlError as exc:
        refuse(as_json, exc)


def refuse(as_json: bool, exc: ControlError) -> NoReturn:
    """Report a control error with its exit code: 3 not running, 4 denied, else 1."""
    code = (EXIT_NOT_RUNNING if isinstance(exc, DaemonNotRunning)
            else EXIT_DENIED if isinstance(exc, PermissionDenied) else EXIT_FAILURE)
    fail(as_json, code, exc.code, exc.message, exc.hint)


def fail(as_json: bool, exit_code: int, code: str, message: str, hint: str = "") -> NoReturn:
    """Report an error (``mlxctl.error/1`` with --json) and exit with ``exit_code``."""
    if as_json:
        echo(json.dumps({"schema": "mlxctl.error/1", "error": {
            "code": code, "message": message, "hint": hint}}, indent=2))
    else:
        echo(f"mlxctl: {message}", err=True)
        if hint:
            echo(f"  hint: {hint}", err=True)
    raise SystemExit(exit_code)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # a stream without a terminal behind it, as click sees it
        return False
