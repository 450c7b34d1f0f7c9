"""``mlxctl``: the control CLI. It talks only to the local daemon, through its client.

Exit codes: 0 ok, 1 failure, 2 usage, 3 daemon not running, 4 permission denied.
Every command takes ``--json``; its output carries a versioned ``schema`` field.

This is the whole command tree (help, completion, usage errors). The program starts in
``mlxctl.main``, which runs the plainest ``status``, ``workers`` and ``logs`` without
importing typer (``mlxctl.fastpath``) and everything else here.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import psutil
import typer
from rich.console import Console

from mlxceld import __version__
from mlxceld.control.clients.typed import ControlClient
from mlxceld.errors import ControlError
from mlxctl import reading, render, verdict
from mlxctl import watch as watching
from mlxctl.cluster import cluster_app
from mlxctl.drain import drain, undrain
from mlxctl.edge import EXIT_FAILURE, call, emit
from mlxctl.options import JsonOpt, SocketOpt, socket_path
from mlxctl.progress import LoadView
from mlxctl.reloading import EPILOG as RELOAD_EPILOG
from mlxctl.reloading import reload
from mlxctl.secret import secret_app
from mlxctl.serving import Served, serve_and_wait
from mlxctl.watch import DEFAULT_INTERVAL_S

STOP_WAIT_S = 120.0

# add_completion: --show-completion SHELL is what Homebrew's completion helper runs.
app = typer.Typer(add_completion=True, pretty_exceptions_enable=False, no_args_is_help=True,
                  rich_markup_mode=None,  # help shows [serve], [v6] as written
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Control the local mlxceld daemon.")
app.add_typer(secret_app, name="secret")
app.add_typer(cluster_app, name="cluster")
app.command(epilog="Exit codes: 0 drained (with --detach: the drain is recorded); 1 not "
            "drained in time, or refused; 2 usage; 3 daemon not running; 4 permission "
            "denied.")(drain)
app.command()(undrain)
app.command(epilog=RELOAD_EPILOG)(reload)


@app.callback()
def main_options(ctx: typer.Context, socket: SocketOpt = None) -> None:
    ctx.obj = socket


@app.command(epilog="With --check, exit codes: 0 healthy; 1 degraded (each finding "
             "printed on a line); 2 usage; 3 the daemon cannot be reached; 4 permission "
             "denied. With --watch: 0 on Ctrl-C.")
def status(
    ctx: typer.Context,
    watch: Annotated[bool, typer.Option(
        "--watch", "-w", help="Show it again every --interval seconds, like top (drawn "
        "in place on a terminal), until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(
        "--interval", min=0.2, help="Seconds between two --watch snapshots.")
    ] = DEFAULT_INTERVAL_S,
    check: Annotated[bool, typer.Option(
        "--check", help="Exit 0 if all is healthy, else 1 and what is not, a line each "
        "(for scripts; see mlxctl(1)).")] = False,
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Show the daemon, its workers, and what is unhealthy (with the next command to run)."""
    path = socket_path(ctx, socket)
    if watch and check:
        raise typer.BadParameter("--check asks once; leave out --watch (or --check)",
                                 param_hint="'--check'")
    given = ctx.get_parameter_source("interval")
    if given is not None and given.name == "COMMANDLINE" and not watch:
        raise typer.BadParameter("--interval is for --watch", param_hint="'--interval'")
    if check:
        raise typer.Exit(verdict.check(path, as_json))
    if watch:
        raise typer.Exit(watching.watch(path, interval, as_json))
    reading.status(path, as_json)


@app.command()
def workers(ctx: typer.Context, socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """List the supervised workers."""
    reading.workers(socket_path(ctx, socket), as_json)


@app.command()
def logs(
    ctx: typer.Context,
    worker: Annotated[str, typer.Argument(help="Worker name (see `mlxctl workers`).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
                      ] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", min=0, max=10_000,
                                       help="How many lines of history.")] = 50,
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Print a worker's log (its stdout and stderr)."""
    reading.logs(socket_path(ctx, socket), worker, lines, follow, as_json)


@app.command(epilog="With --follow --json: one mlxctl.event/1 object a line (id, ts, "
             "kind, subject, message, data), every new event in order until Ctrl-C (exit "
             "130) or the daemon stops (exit 0).")
def events(
    ctx: typer.Context,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")
                      ] = False,
    last: Annotated[int, typer.Option("--last", "-n", min=1, max=1000,
                                      help="How many past events to show.")] = 20,
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Print the daemon's event log (worker starts, exits, restarts, ...)."""

    async def job(c: ControlClient) -> None:
        if not follow:
            body = await c.events(after=-last, limit=last)
            emit(as_json, "events", body,
                 lambda: "\n".join(render.event_line(e) for e in body["events"]) or "no events")
            return
        seen: int | None = None
        try:
            async for event in c.follow_events(after=-last):
                seen = event.get("id", seen)
                typer.echo(json.dumps({"schema": "mlxctl.event/1", **event}) if as_json
                           else render.event_line(event))
        except ControlError as exc:  # the stream broke off: the daemon stops, or cut us
            raise ControlError(
                "the event stream ended" + (f" after event {seen}" if seen else "")
                + f": {exc.message}", code=exc.code,
                hint="the daemon disconnects a follower that reads nothing for 30 s (and "
                "ends every stream when it stops); run mlxctl events -f again, with -n N "
                "for the events missed meanwhile") from exc

    call(socket_path(ctx, socket), as_json, job)


@app.command(epilog="Exit codes: 0 the chat ended (/exit, Ctrl-D, the end of piped "
             "input); 1 the router does not answer, refuses the API key, or the daemon "
             "serves nothing; 2 usage; 3 daemon not running; 4 permission denied; 130 "
             "Ctrl-C at the prompt of piped input.")
def chat(
    ctx: typer.Context,
    system: Annotated[str | None, typer.Option(
        "--system", help="A system prompt, sent first with every question.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="The model id to ask (default: the one the router serves).")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", min=1, help="The most tokens of each answer (default: the "
        "router's).")] = None,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", min=0.0, max=2.0, help="Sampling temperature (default: the "
        "router's).")] = None,
    url: Annotated[str | None, typer.Option(
        "--url", help="The router's OpenAI URL, ending in /v1 (default: what the daemon "
        "serves, from mlxctl status; with --url the daemon is not asked).")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", help="A file holding the router's API key (default: the "
        "daemon's key file, serve.api_key_file, when it has one and this user can read "
        "it).")
    ] = None,
    socket: SocketOpt = None,
) -> None:
    """Chat with the router in the terminal: answers stream as they come, the history is
    kept (/reset clears it, /exit or Ctrl-D ends), Ctrl-C stops an answer, a reasoning
    model's thinking is shown apart. Piped input is read a line a turn."""
    from mlxctl import chat as chatting  # httpx: only for this command

    raise typer.Exit(chatting.start(
        socket_path(ctx, socket), url, api_key_file, model,
        chatting.Conversation(system), chatting.Sampling(max_tokens, temperature)))


@app.command()
def restart(
    ctx: typer.Context,
    worker: Annotated[str, typer.Argument(help="Worker name (see `mlxctl workers`).")],
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Restart a worker (also the way to bring back a worker that failed)."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.restart(worker))
    emit(as_json, "restart", body, lambda: f"restarting worker {worker}")


@app.command(epilog="Exit codes: 0 served (with --wait: the router runs); 1 refused, or "
             "the router failed, exited, stalled or did not run within --timeout (the reason "
             "is printed); 2 usage; 3 daemon not running; 4 permission denied.")
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(
        help="A local mlx-lm model directory, or a Hugging Face repo id.")],
    name: Annotated[str | None, typer.Option(
        "--name", help="The model id clients see (default: the directory name); a,b,...: "
        "the first is the id, the others aliases a request may name it by.")] = None,
    wait: Annotated[bool, typer.Option(
        "--wait/--no-wait", help="Wait until the model is loaded and served, showing how "
        "far it has loaded (a bar on a terminal, else a line per tenth).")] = True,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=1, help="Seconds to wait for the router to run, in all (a load "
        "that reads nothing for 60 s ends the wait sooner).")] = 600.0,
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Serve MODEL on the running daemon (starts or restarts its router worker)."""
    local = Path(model).expanduser()
    target = str(local.resolve()) if local.exists() else model  # the daemon has another cwd
    path = socket_path(ctx, socket)
    if not wait:
        body = call(path, as_json, lambda c: c.serve(target, name))
        serving = body["serving"] or {}
        emit(as_json, "serve", body, lambda: f"serving {serving.get('model_name')} at "
             f"{serving.get('url')}")
        return
    view = None if as_json else LoadView(
        typer.echo, Console() if sys.stdout.isatty() else None)

    async def job(c: ControlClient) -> Served:
        try:
            return await serve_and_wait(c, target, name, timeout, view)
        finally:
            if view is not None:
                view.close()

    served = call(path, as_json, job)
    body = {**served.body, "router": served.router}
    if served.problem:
        body["problem"] = served.problem
    serving = served.body.get("serving") or {}
    if as_json:
        emit(as_json, "serve", body, lambda: "")
    elif not served.problem:
        typer.echo(f"serving {serving.get('model_name')} at {serving.get('url')} "
                   f"(router {served.router['state']})")
    else:
        typer.echo(f"mlxctl: {served.problem}", err=True)
        typer.echo("  hint: see: mlxctl logs router", err=True)
    if served.problem:
        raise typer.Exit(EXIT_FAILURE)


@app.command(epilog="Exit codes: 0 the router is stopped (or nothing was served); 1 "
             "refused: the model comes from --model or [serve] model (a restart would serve "
             "it again), or the router is a cluster's; 3 daemon not running; 4 permission "
             "denied.")
def unserve(ctx: typer.Context, socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Stop serving: stop the router of a single-host daemon and forget what `mlxctl serve`
    chose, so that a restart does not serve it again. The daemon keeps running."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.unserve())
    was = body.get("unserved")
    emit(as_json, "unserve", body, lambda: f"stopped serving {was['model_name']} ({was['model']})"
         if was else "nothing was served; nothing changed")


@app.command()
def stop(
    ctx: typer.Context,
    wait: Annotated[bool, typer.Option("--wait/--no-wait",
                                       help="Wait until the daemon has exited.")] = True,
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Stop the daemon: its workers get their stop timeout, then it exits."""
    path = socket_path(ctx, socket)
    body = call(path, as_json, lambda c: c.stop())
    pid = int(body["pid"])
    gone = _wait_gone(pid, path) if wait else False
    body["stopped"] = gone
    emit(as_json, "stop", body, lambda: f"mlxceld (pid {pid}) "
         + ("stopped" if gone else "is stopping" if not wait else
            f"still running after {STOP_WAIT_S:.0f} s"))
    if wait and not gone:
        raise typer.Exit(EXIT_FAILURE)


def _wait_gone(pid: int, path: Path) -> bool:
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        if not path.exists() and not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    """Running and not a zombie (a daemon whose parent has not reaped it yet has exited)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


model_app = typer.Typer(help="Model files on this machine (no daemon needed).",
                        no_args_is_help=True, rich_markup_mode=None)
app.add_typer(model_app, name="model")


@model_app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def fixture(ctx: typer.Context) -> None:
    """Write a random-weight mlx-lm model (for tests and demos): DIR [--preset tiny|small|
    qwen3-0.6b] [--family llama|qwen3] [--quantize BITS] ... (--help for all options)."""
    from mlxceld.models import run_cli  # imports mlx: only for this command

    raise typer.Exit(run_cli(list(ctx.args), prog="mlxctl model fixture"))


@app.command()
def version(ctx: typer.Context, socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Print mlxctl's version and the daemon's."""
    path = socket_path(ctx, socket)
    if not as_json:
        typer.echo(f"mlxctl  {__version__}")
    body = call(path, as_json, lambda c: c.version())
    emit(as_json, "version", {"client": __version__, "daemon": body["version"],
                              "api": body["api"]},
         lambda: f"mlxceld {body['version']} (control API {body['api']})")


def main() -> None:
    """The entry point of installs made before ``mlxctl.main`` was: the same program."""
    from mlxctl.main import main as start

    start()
