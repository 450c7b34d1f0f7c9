"""``mlxctl secret``: the cluster keyring (PROTOCOL.md section 1).

``generate`` needs no daemon; the others talk to it. A secret travels only in
a file or in the body of a request on the 0600, peer-checked control socket:
never in argv, never in the daemon's database or logs. Key ids (16 hex
digits) are not secret.
"""

from __future__ import annotations

import datetime
import os
import secrets
import stat
from pathlib import Path
from typing import Annotated, Any

import typer

from mlxceld.privatefile import write_private
from mlxceld.wire.secret import MIN_SECRET_BYTES, key_id, trim_secret_file
from mlxctl import render
from mlxctl.edge import EXIT_FAILURE, EXIT_USAGE, call, emit, fail
from mlxctl.options import JsonOpt, SocketOpt, socket_path

GENERATED_BYTES = 32

secret_app = typer.Typer(help="The cluster secret keyring: generate, install, list, use, remove, "
                         "rotate.",
                         no_args_is_help=True, rich_markup_mode=None)

KeyIdArg = Annotated[str, typer.Argument(help="A key id (16 hex digits; see `mlxctl secret "
                                               "list`).")]


@secret_app.command()
def generate(
    file: Annotated[Path | None, typer.Argument(
        help="Write the secret here (mode 0600). Without it, print it to stdout.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace FILE if it exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Make a new cluster secret: 32 random bytes, written as hex and a newline.

    The secret is the hex text itself (64 bytes); copy the file to every node and
    install it there (`mlxctl secret install FILE`), or pass it to mlxceld with
    --cluster-secret-file.
    """
    text = secrets.token_bytes(GENERATED_BYTES).hex()
    kid = key_id(text.encode()).hex()
    if file is None:
        typer.echo("mlxctl: warning: this is a cluster secret; keep it out of shell history, "
                   "logs and chat (write it to a file instead: mlxctl secret generate FILE)",
                   err=True)
        emit(as_json, "secret_generate", {"key_id": kid, "file": None, "secret": text},
             lambda: text)
        return
    try:
        _write_new(file, (text + "\n").encode(), force)
    except FileExistsError:
        fail(as_json, EXIT_FAILURE, "exists", f"{file} already exists; not overwriting it",
             "pick another name, or pass --force to replace it")
    except OSError as exc:
        fail(as_json, EXIT_FAILURE, "io", f"cannot write {file}: {exc.strerror or exc}",
             "check the directory and its permissions")
    emit(as_json, "secret_generate", {"key_id": kid, "file": str(file.absolute())},
         lambda: f"wrote a new cluster secret to {file} (key id {kid}, mode 0600)\n"
         f"  next: mlxctl secret install {file} --primary")


@secret_app.command("list")
def list_(ctx: typer.Context, socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """List the daemon's cluster secrets by key id and state (never the secrets)."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.secrets())
    emit(as_json, "secrets", body, lambda: _table(body["keys"]))


@secret_app.command()
def install(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="The secret file (one trailing newline is "
                                              "trimmed; at least 16 bytes remain).")],
    primary: Annotated[bool, typer.Option(
        "--primary", help="Make it the primary: the secret this node connects with.")] = False,
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Install the secret in FILE into the daemon's keyring (exit 2 if FILE is unusable)."""
    secret = _read_secret(file, as_json)
    source = f"mlxctl secret install {file.absolute()}"
    body = call(socket_path(ctx, socket), as_json,
                lambda c: c.install_secret(secret, primary=primary, source=source))
    key = body["key"]
    emit(as_json, "secret_install", body,
         lambda: f"installed cluster secret {key['key_id']} ({key['state']})")


@secret_app.command()
def use(ctx: typer.Context, kid: KeyIdArg, socket: SocketOpt = None,
        as_json: JsonOpt = False) -> None:
    """Make KEYID the primary: the secret this node uses when it connects."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.use_secret(kid))
    emit(as_json, "secret_use", body,
         lambda: f"cluster secret {body['key']['key_id']} is now the primary")


@secret_app.command()
def remove(ctx: typer.Context, kid: KeyIdArg, socket: SocketOpt = None,
           as_json: JsonOpt = False) -> None:
    """Remove KEYID from the keyring (never the primary: `use` another first)."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.remove_secret(kid))
    emit(as_json, "secret_remove", body,
         lambda: f"removed cluster secret {body['key']['key_id']}")


@secret_app.command()
def rotate(
    ctx: typer.Context,
    new_secret_file: Annotated[Path | None, typer.Option(
        "--new-secret-file", help="The new secret (mode 0600, one trailing newline trimmed, "
        "at least 16 bytes remain). Without it the latest rotation, if it failed, is "
        "taken up again at the step it failed; else the daemon generates one.")] = None,
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Rotate the cluster secret on this daemon and every peer it knows (mlxctl cluster
    nodes): install the new secret everywhere, verify, make it the primary everywhere,
    verify, remove the old one. Refused, changing nothing, while a member is unreachable;
    exit 1 naming every member that failed a step; run it again (without
    --new-secret-file) once they are back to finish that rotation. A daemon killed
    meanwhile resumes the rotation when it starts again (mlxctl secret list --json shows
    its step)."""
    secret = None
    if new_secret_file is not None:
        secret = _read_secret(new_secret_file, as_json, private=True)
    body = call(socket_path(ctx, socket), as_json, lambda c: c.rotate_secret(secret))
    rot = body["rotation"]
    emit(as_json, "secret_rotate", body,
         lambda: f"rotated the cluster secret from key {rot['old_key_id']} to "
         f"{rot['new_key_id']} on {len(rot['members'])} member(s): "
         + ", ".join(rot["members"]))


def _write_new(path: Path, content: bytes, force: bool) -> None:
    """0600 from the first byte; with ``force`` a temp file renamed over the old one."""
    if force:
        write_private(path, content)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never over a file
    try:
        os.write(fd, content)
    finally:
        os.close(fd)


def _read_secret(file: Path, as_json: bool, *, private: bool = False) -> bytes:
    """The secret in ``file``; with ``private`` one that group or others may read is
    refused (exit 2), else only warned about."""
    try:
        with file.open("rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            secret = trim_secret_file(f.read())
    except OSError as exc:
        fail(as_json, EXIT_USAGE, "bad_file", f"cannot read {file}: {exc.strerror or exc}",
             "check the path and its permissions")
    if mode & 0o077 and private:
        fail(as_json, EXIT_USAGE, "bad_file", f"{file} is readable by group or others (mode "
             f"{mode:04o}); a new cluster secret must be private", f"run: chmod 600 {file}")
    if mode & 0o077:
        typer.echo(f"mlxctl: warning: {file} is readable by group or others (mode {mode:04o}); "
                   f"run: chmod 600 {file}", err=True)
    if len(secret) < MIN_SECRET_BYTES:
        fail(as_json, EXIT_USAGE, "bad_secret",
             f"{file} holds {len(secret)} byte(s) after trimming one trailing newline; at least "
             f"{MIN_SECRET_BYTES} are needed", "`mlxctl secret generate FILE` makes a good one")
    return secret


def _table(keys: list[dict[str, Any]]) -> str:
    if not keys:
        return ("no cluster secrets installed\n  next: mlxctl secret generate FILE && "
                "mlxctl secret install FILE --primary")
    rows = [[k["key_id"], k["state"],
             datetime.datetime.fromtimestamp(k["created_at"]).strftime("%Y-%m-%d %H:%M:%S"),
             k["source"]] for k in keys]
    colors: list[list[str | None]] = [
        ["green" if k["state"] == "primary" else None, None, None, None] for k in keys]
    return render.table(["KEY ID", "STATE", "INSTALLED", "SOURCE"], rows, colors)
