"""What every worker subprocess runs around its role.

The daemon starts ``python -m mlxceld.workers --role R --name N`` in a new
session, with stdout and stderr on the worker's log file and a bootstrap JSON
document (``WorkerBootstrap``) on stdin; it logs there in the daemon's format (the
bootstrap's ``log_format``, ``logformat.py``). The runtime reads the bootstrap, serves the
worker's control channel (a Unix socket, newline-delimited JSON: ``health``,
``stats``, ``stop``, ``keyring``, ``streams`` and ``api_key``: ``supervisor/keys.py``,
and the role's own ``ops``, which get the request's object), runs the role, and leaves an
exit record for a daemon that may have adopted it after a restart. A role that does
steps of work sets ``WorkerContext.progress``; its ``health`` answer then carries
``progress`` (``types.WorkerProgress``, made by ``progress_report``), which the
supervisor's watchdog reads; a worker with the cluster keyring carries ``keys``
(``types.WorkerKeys``: key ids only), one with an API key (or that asks one of its
clients) its tag (``api_key``: a salt and an HMAC, never the key).

The role's options are read once, here, into their typed spec
(``workers/options.py``): a bad one is named in the log and the exit record
(kind ``config``) and the worker exits ``EXIT_CONFIG`` before its role runs. A
role that raises ``ConfigError`` (a stage whose model cannot be loaded: a family
it does not split, a missing shard, a bad config.json) exits the same way, its
message and hint in the record, at once (``exit_at_once``: no interpreter teardown,
where mlx may abort): the supervisor does not restart a ``config`` exit
(``supervisor/states.py``), since the same start would fail the same way.

A role waits for a long call (a model's download or load) with ``unless_stopped``:
told to stop meanwhile (SIGTERM, the ``stop`` op), it raises ``Stopped`` and the worker
exits 0 at once, the call's thread left unfinished, rather than at the call's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

from mlxceld.errors import ConfigError
from mlxceld.logformat import formatter
from mlxceld.net import retire_streams, streams_under
from mlxceld.roles import WORKER_ROLES
from mlxceld.roles.options import EXIT_CONFIG, WorkerOptions, parse_options
from mlxceld.supervisor.keys import api_key_tag
from mlxceld.supervisor.ops import (
    ApiKeyUpdate,
    Health,
    KeyringUpdate,
    OpError,
    Stats,
    Stop,
    StreamsUnder,
)
from mlxceld.tasks import scoped_group
from mlxceld.types import (
    JSON,
    ExitRecord,
    LoadProgress,
    WorkerBootstrap,
    WorkerHealth,
    WorkerKeys,
    WorkerProgress,
)
from mlxceld.wire.secret import Keyring

log = logging.getLogger(__name__)

MAX_BOOTSTRAP = 1 << 20
MAX_REQUEST = 64 * 1024
CHANNEL_IDLE_S = 30.0  # a control connection that sends nothing for this long is closed
MAX_SUMMARY = 1000  # characters of a ConfigError's message and hint kept in the exit record

Opts = TypeVar("Opts", bound=WorkerOptions)


@dataclass
class WorkerContext(Generic[Opts]):
    """Handed to a role's ``run``: its identity, options and the knobs it reports through."""

    name: str
    role: str
    options: Opts
    state_dir: Path
    # The cluster keyring (the bootstrap's secret_hex and accepted_hex), or None: changed
    # in place by the control channel's ``keyring`` op (supervisor/keys.py); a role hands
    # this very object to its listeners and dialers.
    keyring: Keyring | None = field(default=None, repr=False)
    # The OpenAI port's API key (the bootstrap's api_key), or None: replaced by the control
    # channel's ``api_key`` op (supervisor/keys.py); a role that asks it of its clients
    # reads it at each request and sets ``guards_api_key``, and its health answers then
    # carry its tag under ``key_salt``.
    api_key: str | None = field(default=None, repr=False)
    guards_api_key: bool = False
    key_salt: bytes = field(default_factory=lambda: os.urandom(16), repr=False)
    started_at: float = field(default_factory=time.time)
    state: WorkerHealth = WorkerHealth.STARTING
    stats: dict[str, Any] = field(default_factory=dict)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # Role-specific control-channel operations (e.g. a standby stage's "activate", the
    # router's "drain"), each handed the request's JSON object.
    ops: dict[str, Callable[[JSON], JSON]] = field(default_factory=dict)
    # Called before each ``stats`` answer, to bring ``stats`` up to date with counts kept
    # elsewhere (a tensor rank's follower counts its steps on a thread of its own).
    stats_hooks: list[Callable[[], None]] = field(default_factory=list)
    # A role that does steps of work: its progress, for the supervisor's watchdog.
    progress: Callable[[], WorkerProgress] | None = None
    # Called (on the worker's loop) when the ``keyring`` op changed the primary: the role
    # hands its outgoing streams over to the new key (pipeline/links.py, stage.py).
    rekeyed: list[Callable[[], None]] = field(default_factory=list)
    # The worker exits at once after its exit record (``exit_at_once``), without the
    # interpreter's teardown: mlx's native threads may abort it (SIGABRT). Only the echo
    # role, acting out a slow teardown, turns it off.
    skip_teardown: bool = True

    def ready(self) -> None:
        """Tell the supervisor (through health probes) that the role can do its work."""
        if self.state is WorkerHealth.STARTING:
            self.state = WorkerHealth.READY
            log.info("worker %s is ready", self.name)

    def stop(self) -> None:
        self.state = WorkerHealth.STOPPING
        self.stopping.set()


RoleMain = Callable[[WorkerContext[WorkerOptions]], Awaitable[int]]


def read_bootstrap() -> WorkerBootstrap:
    raw = sys.stdin.buffer.read(MAX_BOOTSTRAP + 1)
    if len(raw) > MAX_BOOTSTRAP:
        raise SystemExit("bootstrap document on stdin is larger than 1 MiB")
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    try:
        boot: WorkerBootstrap = json.loads(raw)
    except ValueError as exc:
        raise SystemExit(f"bootstrap document on stdin is not JSON: {exc}") from exc
    return boot


async def serve_channel(ctx: WorkerContext[WorkerOptions], path: Path) -> asyncio.Server:
    """Listen on the worker's control socket (0600; the state dir around it is 0700)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    old = os.umask(0o177)
    try:
        server = await asyncio.start_unix_server(
            lambda r, w: _serve_client(ctx, r, w), path=str(path), limit=MAX_REQUEST
        )
    finally:
        os.umask(old)
    return server


async def _serve_client(
    ctx: WorkerContext[WorkerOptions], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while True:
            async with asyncio.timeout(CHANNEL_IDLE_S):
                line = await reader.readline()
            if not line:
                break
            writer.write(json.dumps(_answer(ctx, line)).encode() + b"\n")
            await writer.drain()
    except (TimeoutError, ValueError, ConnectionError):
        pass  # idle, oversized or vanished client: just close
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def _answer(ctx: WorkerContext[WorkerOptions], line: bytes) -> JSON:
    try:
        request = json.loads(line)
        op = request["op"]
        if not isinstance(request, dict):
            raise TypeError(request)
    except (ValueError, KeyError, TypeError):
        return {"ok": False, "error": "request must be a JSON object with an 'op'"}
    if op == Health.OP:
        answer: JSON = {"ok": True, "name": ctx.name, "role": ctx.role, "pid": os.getpid(),
                        "state": ctx.state, "started_at": ctx.started_at}
        if ctx.progress is not None:
            answer["progress"] = ctx.progress()
        if ctx.keyring is not None:
            answer["keys"] = _keys(ctx.keyring)
        if ctx.guards_api_key or ctx.api_key is not None:
            answer["api_key"] = _api_key(ctx)
        return answer
    if op == KeyringUpdate.OP:
        return _take_keyring(ctx, request)
    if op == ApiKeyUpdate.OP:
        return _take_api_key(ctx, request)
    if op == StreamsUnder.OP:
        return _streams(ctx, request)
    if op == Stats.OP:
        for hook in ctx.stats_hooks:
            hook()
        return {"ok": True, "stats": dict(ctx.stats)}
    if op == Stop.OP:
        ctx.stop()
        return {"ok": True}
    if op in ctx.ops:
        return ctx.ops[op](request)
    return {"ok": False, "error": f"unknown op {op!r}"}


def _keys(keyring: Keyring) -> WorkerKeys:
    assert keyring.primary_id is not None
    return {"primary": keyring.primary_id.hex(), "ids": [k.hex() for k in keyring.ids()]}


def _take_keyring(ctx: WorkerContext[WorkerOptions], request: dict[str, object]) -> JSON:
    """The ``keyring`` op: swap the keyring in place, end the streams under a key it no
    longer holds (their owners re-dial under the primary)."""
    if ctx.keyring is None:
        return {"ok": False, "error": f"worker {ctx.name} speaks no MXCL and holds no keyring"}
    try:
        primary, accepted = KeyringUpdate.from_wire(request).secrets()
    except OpError as exc:
        return {"ok": False, "error": f"keyring: {exc}"}
    was = ctx.keyring.primary_id
    dropped = ctx.keyring.replace_all(primary, accepted)
    ended = retire_streams(ctx.keyring) if dropped else 0
    keys = _keys(ctx.keyring)
    log.info("worker %s: keyring now %s (primary %s); %d stream(s) under a removed key "
             "ended", ctx.name, ", ".join(keys["ids"]), keys["primary"], ended)
    if ctx.keyring.primary_id != was:
        for hand_over in ctx.rekeyed:
            hand_over()
    return {"ok": True, "keys": keys, "ended": ended}


def _api_key(ctx: WorkerContext[WorkerOptions]) -> JSON:
    return {"salt": ctx.key_salt.hex(), "tag": api_key_tag(ctx.api_key, ctx.key_salt)}


def _take_api_key(ctx: WorkerContext[WorkerOptions], request: dict[str, object]) -> JSON:
    """The ``api_key`` op: the OpenAI port's key replaced; the next request is checked
    against the new one. Never logs the key."""
    try:
        key = ApiKeyUpdate.from_wire(request).api_key
    except OpError as exc:
        return {"ok": False, "error": f"api_key: {exc}"}
    if key != ctx.api_key:
        ctx.api_key = key
        log.info("worker %s: API key %s", ctx.name,
                 "replaced" if key is not None else "removed: clients need none")
    return {"ok": True, "api_key": _api_key(ctx)}


def _streams(ctx: WorkerContext[WorkerOptions], request: dict[str, object]) -> JSON:
    """The ``streams`` op: how many open MXCL streams of this worker are under key id
    ``kid`` (hex), so that a rotation removes a key only once nothing uses it."""
    try:
        kid = StreamsUnder.from_wire(request).kid
    except OpError as exc:
        return {"ok": False, "error": f"streams: {exc}"}
    return {"ok": True, "streams": streams_under(bytes.fromhex(kid))}


def progress_report(steps: int, last_step: float | None,
                    busy_since: float | None) -> WorkerProgress:
    """``WorkerProgress`` from a role's counts: ``last_step`` (when the last step ended)
    and ``busy_since`` (when it got work it still has; None: it has none) are
    ``time.monotonic()`` readings of this process."""
    now = time.monotonic()
    stalled = 0.0
    if busy_since is not None:
        stalled = max(0.0, now - max(busy_since, last_step if last_step is not None
                                     else busy_since))
    return {"steps": steps,
            "last_step_at": None if last_step is None else time.time() - (now - last_step),
            "busy": busy_since is not None, "stalled_s": round(stalled, 3)}


def load_reporter(ctx: WorkerContext[Any], since: float, slow_s: float | None = None,
                  step: str | None = None) -> Callable[[int, int], None]:
    """A model load's ``progress(done, total)`` (``models/reading.py``), called on the
    loading thread: each report lands in the worker's stats as ``loading``
    (``types.LoadProgress``, ``since`` its wall-clock start), which its daemon shows in
    ``mlxctl status`` and systemd's STATUS line; the role pops it once loaded. ``slow_s``
    (tests only: ``failpoints``' ``*_LAYER_S``) pauses after each step but the last, as a
    slow disk would, until the worker is told to stop. ``step``: what the bytes are, when
    not read from disk (``downloading``: a stage's shards fetched first)."""
    loop = asyncio.get_running_loop()

    def loaded(done: int, total: int) -> None:
        report = LoadProgress(done=done, total=total, since=since)
        if step is not None:
            report["step"] = step
        loop.call_soon_threadsafe(ctx.stats.update, {"loading": report})
        if slow_s is not None and done < total:
            until = time.monotonic() + slow_s
            while time.monotonic() < until and not ctx.stopping.is_set():
                time.sleep(0.05)

    return loaded


class Stopped(Exception):
    """The worker was told to stop while it waited for ``unless_stopped``'s call (named
    by the exception's text). A role lets it through: the worker exits 0 (``run_worker``)."""


async def unless_stopped(ctx: WorkerContext[Any], name: str, call: Callable[[], Any]) -> Any:
    """``call()`` on a daemon thread of its own (named ``name``), awaited; raises
    ``Stopped`` if the worker is told to stop first. Unlike ``asyncio.to_thread``'s pool
    (joined at the loop's close), a thread left behind (a model half read, a ring not yet
    formed) never holds up the worker's exit (``exit_at_once``)."""
    loop = asyncio.get_running_loop()
    work: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if work.done():
            return
        if error is not None:
            work.set_exception(error)
        else:
            work.set_result(result)

    def body() -> None:
        try:
            result: Any = call()
            error: BaseException | None = None
        except BaseException as exc:  # handed to the awaiting task
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: the worker is exiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=body, name=name, daemon=True).start()
    async with scoped_group() as tg:  # whichever comes first; the wait for a stop ends here
        stopping = tg.create_task(ctx.stopping.wait())
        await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not work.done():
        raise Stopped(name)
    return work.result()


async def fetched_path(ctx: WorkerContext[Any], model: str) -> str:
    """``model``'s local directory: a repo id's files fetched first, with progress
    (``downloading`` in its stats)."""
    from mlxceld.models.fetch import fetch_whole, names_a_repo

    if not names_a_repo(model):
        return model
    fetched = load_reporter(ctx, time.time(), step="downloading")
    return str(await unless_stopped(ctx, "download", lambda: fetch_whole(model, fetched)))


def write_exit_record(path: Path, returncode: int, kind: str, summary: str) -> None:
    record: ExitRecord = {"pid": os.getpid(), "returncode": returncode, "kind": kind,
                          "summary": summary}
    with contextlib.suppress(OSError):
        path.write_text(json.dumps(record))


async def run_worker(boot: WorkerBootstrap, options: WorkerOptions,
                     made: list[WorkerContext[WorkerOptions]] | None = None) -> int:
    """Run the role of ``boot`` with ``options``; ``made`` is given the context."""
    if "hf_token" in boot:  # huggingface_hub reads it at each call; no child inherits it
        os.environ["HF_TOKEN"] = boot["hf_token"]
    keyring = None
    if "secret_hex" in boot:
        keyring = Keyring()
        keyring.replace_all(bytes.fromhex(boot["secret_hex"]),
                            [bytes.fromhex(h) for h in boot.get("accepted_hex", [])])
    ctx = WorkerContext(boot["name"], boot["role"], options, Path(boot["state_dir"]), keyring,
                        boot.get("api_key"))
    if made is not None:
        made.append(ctx)
    module = importlib.import_module(WORKER_ROLES[boot["role"]])
    role_main: RoleMain = module.run
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, ctx.stop)
    server = await serve_channel(ctx, Path(boot["control_socket"]))
    try:
        return await role_main(ctx)
    except Stopped as stopped:  # told to stop while it loaded: nothing to finish
        log.info("worker %s told to stop during its %s: it exits without finishing it",
                 ctx.name, stopped)
        return 0
    finally:
        server.close()


def exit_at_once(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's teardown, once the exit record is
    written: nothing a worker holds outlives it (its state is the daemon's), and mlx may
    still hold a native thread whose destruction aborts the process at teardown
    ("terminate called without an active exception": SIGABRT). Seen after a model failed
    to load (1 run in 3 here), with a tensor-parallel rank's ring, and after a stage's
    drain (1 run in 6 of test_stage_drain.py); the supervisor would read a crash, not
    this exit and its record."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: list[str]) -> int:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter("text"))  # until the bootstrap says which
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    boot = read_bootstrap()
    handler.setFormatter(formatter("json" if boot.get("log_format") == "json" else "text"))
    exit_record = Path(boot["exit_record"])
    with contextlib.suppress(FileNotFoundError):
        exit_record.unlink()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    try:
        options = parse_options(boot["role"], boot["options"])
    except ConfigError as exc:
        summary = f"refused its options: {exc.message}"
        log.error("worker %s %s (%s)", boot["name"], summary, exc.hint)
        write_exit_record(exit_record, EXIT_CONFIG, "config", summary)
        return EXIT_CONFIG
    made: list[WorkerContext[WorkerOptions]] = []
    try:
        code = asyncio.run(run_worker(boot, options, made))
    except ConfigError as exc:  # e.g. a stage's model it cannot load: a restart cannot help
        said = exc.message + (f"; {exc.hint}" if exc.hint else "")
        summary = " ".join(said.split())[:MAX_SUMMARY]  # one line, as a status shows it
        log.error("worker %s %s", boot["name"], summary)
        write_exit_record(exit_record, EXIT_CONFIG, "config", summary)
        exit_at_once(EXIT_CONFIG)
    except Exception as exc:
        traceback.print_exc()
        last = traceback.format_exception_only(exc)[-1].strip()
        write_exit_record(exit_record, 1, "exception", f"Python exception: {last}")
        if made and made[0].skip_teardown:
            exit_at_once(1)
        return 1
    kind = "clean" if code == 0 else "status"
    write_exit_record(exit_record, code, kind, "exited cleanly" if code == 0
                      else f"exited with status {code}")
    if made and made[0].skip_teardown:
        exit_at_once(code)
    return code
