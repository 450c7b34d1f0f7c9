"""mlxctl's edge: shared options, the one place a client job runs, and JSON output.

Exit codes: 0 ok, 1 failure, 2 usage, 3 daemon not running, 4 permission denied.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from mlxceld.control.client import ControlClient
from mlxceld.errors import ControlError, DaemonNotRunning, PermissionDenied
from mlxceld.paths import client_socket

EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_DENIED = 1, 2, 3, 4

SocketOpt = Annotated[Path | None, typer.Option(
    "--socket", envvar="MLXCELD_SOCKET", show_envvar=True,
    help="The daemon's control socket. Default: $XDG_RUNTIME_DIR/mlxceld/mlxceld.sock, "
    "else <state-dir>/mlxceld.sock.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
T = TypeVar("T")


def socket_path(ctx: typer.Context, socket: Path | None) -> Path:
    return socket or ctx.obj or client_socket()


def emit(as_json: bool, schema: str, body: dict[str, Any], text: Callable[[], str]) -> None:
    if as_json:
        typer.echo(json.dumps({**body, "schema": f"mlxctl.{schema}/1"}, indent=2))
    else:
        typer.echo(text())


def call(path: Path, as_json: bool, job: Callable[[ControlClient], Awaitable[T]]) -> T:
    """Run one client job at the CLI's edge; map our errors to exit codes and messages."""

    async def go() -> T:
        async with ControlClient(path) as client:
            return await job(client)

    try:
        return asyncio.run(go())
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except ControlError as exc:
        code = (EXIT_NOT_RUNNING if isinstance(exc, DaemonNotRunning)
                else EXIT_DENIED if isinstance(exc, PermissionDenied) else EXIT_FAILURE)
        fail(as_json, code, exc.code, exc.message, exc.hint)


def fail(as_json: bool, exit_code: int, code: str, message: str, hint: str = "") -> NoReturn:
    """Report an error (``mlxctl.error/1`` with --json) and exit with ``exit_code``."""
    if as_json:
        typer.echo(json.dumps({"schema": "mlxctl.error/1", "error": {
            "code": code, "message": message, "hint": hint}}, indent=2))
    else:
        typer.echo(f"mlxctl: {message}", err=True)
        if hint:
            typer.echo(f"  hint: {hint}", err=True)
    raise typer.Exit(exit_code)
