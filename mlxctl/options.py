"""The options every daemon command shares, as typer declares them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mlxceld.paths import client_socket

SocketOpt = Annotated[Path | None, typer.Option(
    "--socket", envvar="MLXCELD_SOCKET", show_envvar=True,
    help="The daemon's control socket. Default: the first that exists of the per-user "
    "socket ($XDG_RUNTIME_DIR/mlxceld/mlxceld.sock, else <state-dir>/mlxceld.sock), the "
    "system one (/run/mlxceld/mlxceld.sock) and Homebrew's "
    "($HOMEBREW_PREFIX/var/run/mlxceld/mlxceld.sock); see mlxctl(1), FILES.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def socket_path(ctx: typer.Context, socket: Path | None) -> Path:
    """The command's ``--socket``, else the one given before the command, else
    ``MLXCELD_SOCKET``, else the first socket present (``mlxceld.paths.client_socket``).
    Both options read the variable too: a value from it never beats a flag."""
    source = ctx.get_parameter_source("socket")
    if socket is not None and source is not None and source.name == "COMMANDLINE":
        return socket
    return ctx.obj or socket or client_socket()
