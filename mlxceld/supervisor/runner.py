"""The thin asyncio shell around ``Lifecycle``: one ``WorkerRunner`` per worker.

A runner owns an inbox of lifecycle events. Its ``drive`` task takes the next
event (or the machine's next timer), feeds the machine, and carries out the
actions it returns: spawn a process, signal its group, record a transition.
Helper tasks only post events: the exit watcher, the readiness probe, the
liveness probe (which also posts the progress a worker reports in its answer, for
the watchdog: ``ProgressReported``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Protocol

from mlxceld import failpoints
from mlxceld.errors import WorkerError
from mlxceld.supervisor import channel, exits, logfiles, process
from mlxceld.supervisor.events import (
    AdoptedRunning,
    BecameReady,
    ExitCause,
    HealthProbed,
    KillRequested,
    LoadAdvanced,
    ProcessExited,
    ProgressReported,
    SendSignal,
    Spawned,
    SpawnFailed,
    SpawnProcess,
    StartRequested,
    StopRequested,
    Transitioned,
)
from mlxceld.supervisor.keys import (
    api_key_tag,
    keys_of,
    reported_api_key,
    reported_keys,
)
from mlxceld.supervisor.ops import ApiKeyUpdate, Health, KeyringUpdate, StreamsUnder
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.states import Lifecycle
from mlxceld.types import WorkerHealth, WorkerKeys, WorkerState

log = logging.getLogger(__name__)

READY_POLL_S = 0.1
LIVENESS_TIMEOUT_S = 2.0
ADOPTED_POLL_S = 0.5
LOG_TAIL_LINES = 40
Event = (StartRequested | StopRequested | KillRequested | AdoptedRunning | Spawned
         | SpawnFailed | BecameReady | HealthProbed | LoadAdvanced | ProgressReported
         | ProcessExited)


class Observer(Protocol):
    """What the supervisor does with what a runner sees (persist, record, log)."""

    def transitioned(self, runner: WorkerRunner, change: Transitioned) -> None: ...
    def spawned(self, runner: WorkerRunner) -> None: ...


class WorkerRunner:
    def __init__(self, spec: WorkerSpec, machine: Lifecycle, observer: Observer,
                 spawn_task: Callable[..., asyncio.Task[None]], health_interval_s: float) -> None:
        self.spec = spec
        self.machine = machine
        self.pid: int | None = None
        self.keys: WorkerKeys | None = None  # its keyring's key ids, as it last reported them
        self.create_time: float | None = None
        self.adopted_since: float | None = None  # an adopted process: since when it runs
        self._observer = observer
        self._task = spawn_task
        self._health_interval_s = health_interval_s
        self._inbox: asyncio.Queue[Event] = asyncio.Queue()
        # (pid, the cgroup's OOM-kill count read while that pid was known alive): read at the
        # spawn, again before each health probe it answers (``exits``: the OOM label)
        self._oom_mark: tuple[int, int | None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def post(self, event: Event) -> None:
        self._inbox.put_nowait(event)

    def adopt(self, pid: int, create_time: float, since: float) -> None:
        """Take over a worker left running by a previous daemon, running ``since`` then."""
        self.pid, self.create_time, self.adopted_since = pid, create_time, since
        self._task(self._watch_adopted(pid, create_time))
        self.post(AdoptedRunning(pid))

    async def drive(self) -> None:
        loop = asyncio.get_running_loop()
        self._task(self._probe_liveness())
        while True:
            deadline = self.machine.next_deadline()
            try:
                async with asyncio.timeout_at(deadline):
                    event = await self._inbox.get()
            except TimeoutError:
                actions = self.machine.handle_timer(loop.time())
            else:
                if isinstance(event, ProcessExited):
                    # Here, not in the watcher: pid and machine state change together, so
                    # no one ever sees "running" without a pid.
                    self.pid = self.create_time = self.adopted_since = None
                actions = self.machine.handle(event, loop.time())
            for action in actions:
                await self._carry_out(action)

    async def _carry_out(self, action: object) -> None:
        if isinstance(action, Transitioned):
            self._observer.transitioned(self, action)
        elif isinstance(action, SpawnProcess):
            await self._spawn()
        elif isinstance(action, SendSignal):
            sig = signal.SIGKILL if action.signal == "KILL" else signal.SIGTERM
            if sig is signal.SIGKILL and failpoints.on("worker-kill-lost"):
                log.critical("fail point worker-kill-lost: worker %s keeps running", self.name)
                return
            if self.pid is not None:
                log.info("worker %s: sending %s to process group %d", self.name, sig.name,
                         self.pid)
                process.signal_group(self.pid, sig)

    async def _spawn(self) -> None:
        oom_before = exits.oom_kill_count()
        try:
            proc = await process.spawn(self.spec)
        except WorkerError as exc:
            self.post(SpawnFailed(exc.message))
            return
        self.pid, self.create_time = proc.pid, process.create_time(proc.pid)
        self._oom_mark = (proc.pid, oom_before)
        self._observer.spawned(self)
        self.post(Spawned(proc.pid))
        self._task(self._watch_child(proc))
        self._task(self._probe_readiness(proc.pid))

    async def _watch_child(self, proc: asyncio.subprocess.Process) -> None:
        returncode = await proc.wait()
        oom_after = exits.oom_kill_count()
        mark = self._oom_mark
        oom_before = mark[1] if mark is not None and mark[0] == proc.pid else None
        grew = None if oom_before is None or oom_after is None else oom_after > oom_before
        cause = exits.read_exit_record(self.spec.exit_record, proc.pid)
        if cause is None or returncode != cause.returncode:
            text, _ = logfiles.tail(self.spec.log_path, LOG_TAIL_LINES)
            cause = exits.classify(returncode, text, oom_kills_grew=grew)
        self._exited(cause)

    async def _watch_adopted(self, pid: int, create_time: float) -> None:
        while process.is_same_process(pid, create_time):
            await asyncio.sleep(ADOPTED_POLL_S)
        cause = exits.read_exit_record(self.spec.exit_record, pid) or ExitCause(
            "unknown", "exited while adopted (its exit status went to init, not to us)")
        self._exited(cause)

    def _exited(self, cause: ExitCause) -> None:
        self.post(ProcessExited(cause))  # the drive loop forgets the pid as it handles this

    async def _probe_readiness(self, pid: int) -> None:
        """Ask the new worker for health until it says ready, it exits, or the machine moves on."""
        while self.pid == pid and self.machine.state is WorkerState.STARTING:
            with contextlib.suppress(WorkerError):
                reply = await channel.call(self.spec.control_socket, Health(), timeout_s=1.0)
                if reply.get("pid") == pid and reply.get("state") == WorkerHealth.READY:
                    self.post(BecameReady())
                    return
            await asyncio.sleep(READY_POLL_S)

    async def _probe_liveness(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            pid = self.pid
            if self.machine.state is not WorkerState.RUNNING or pid is None:
                continue
            oom_kills = exits.oom_kill_count()
            try:
                reply = await channel.call(self.spec.control_socket, Health(),
                                           timeout_s=LIVENESS_TIMEOUT_S)
            except WorkerError as exc:
                # Its exit record is written: its role is done, and it is exiting.
                exiting = exits.read_exit_record(self.spec.exit_record, pid) is not None
                self.post(HealthProbed(False, exc.message, stopping=exiting))
            else:
                if self.pid == pid:  # it answered after the count: no OOM kill of it before
                    self._oom_mark = (pid, oom_kills)
                stopping = reply.get("state") == WorkerHealth.STOPPING
                if not self.machine.healthy or stopping:
                    self.post(HealthProbed(True, stopping=stopping))
                progress = progress_of(reply)
                if progress is not None and self.pid == pid:
                    self.post(progress)
                await self._converge_keys(reply)
                await self._converge_api_key(reply)

    async def push_keys(self) -> WorkerKeys | None:
        """Send the worker its spec's keyring (``supervisor/keys.py``) and return the key
        ids it then holds; None for a worker without a secret or a process. Raises
        ``WorkerError`` (naming the worker, never a secret) when it does not take it."""
        s = self.spec
        if s.secret is None or self.pid is None:
            return None
        try:
            reply = await channel.call(s.control_socket, KeyringUpdate.of(s.secret, s.accepted),
                                       timeout_s=LIVENESS_TIMEOUT_S)
        except WorkerError as exc:
            raise WorkerError(f"worker {s.name!r} did not take the new keyring: {exc.message}",
                              hint=f"see mlxctl logs {s.name}; it is sent again at its next "
                              "health probe") from exc
        self.keys = reported_keys(reply)
        return self.keys

    async def streams_under(self, kid: str) -> int:
        """The worker's open MXCL streams under key id ``kid`` (0 without a process or a
        secret); ``WorkerError`` when it does not answer within ``LIVENESS_TIMEOUT_S``."""
        if self.spec.secret is None or self.pid is None:
            return 0
        reply = await channel.call(self.spec.control_socket, StreamsUnder(kid),
                                   timeout_s=LIVENESS_TIMEOUT_S)
        count = reply.get("streams")
        return count if type(count) is int else 0

    async def _converge_keys(self, reply: dict[str, object]) -> None:
        """A worker whose keyring is not its spec's (adopted after a restart, or started
        while the keyring changed) is sent its spec's again."""
        self.keys = reported_keys(reply)
        s = self.spec
        if s.secret is None or self.keys == keys_of(s.secret, s.accepted):
            return
        log.info("worker %s holds keys %s, not its spec's: sending its keyring", s.name,
                 self.keys)
        try:
            await self.push_keys()
        except WorkerError as exc:
            log.warning("%s", exc.message)

    async def push_api_key(self) -> None:
        """Send the worker its spec's API key (``supervisor/keys.py``); nothing without a
        process. Raises ``WorkerError`` (naming the worker, never the key) when it does not
        take it."""
        s = self.spec
        if self.pid is None:
            return
        try:
            await channel.call(s.control_socket, ApiKeyUpdate(s.api_key),
                                       timeout_s=LIVENESS_TIMEOUT_S)
        except WorkerError as exc:
            raise WorkerError(f"worker {s.name!r} did not take the new API key: "
                              f"{exc.message}", hint=f"see mlxctl logs {s.name}; it is sent "
                              "again at its next health probe") from exc
        log.info("worker %s: sent its new API key", s.name)

    async def _converge_api_key(self, reply: dict[str, object]) -> None:
        """A worker whose API key is not its spec's (adopted after a restart, or started
        while a reload changed it) is sent its spec's again."""
        held = reported_api_key(reply)
        if held is None or api_key_tag(self.spec.api_key, held[0]) == held[1]:
            return
        log.info("worker %s holds another API key than its spec's: sending it", self.name)
        try:
            await self.push_api_key()
        except WorkerError as exc:
            log.warning("%s", exc.message)

    async def wait_stopped(self) -> None:
        """Return once the machine rests in EXITED or FAILED with no process left."""
        while not (self.machine.state in (WorkerState.EXITED, WorkerState.FAILED)
                   and self.pid is None):
            await asyncio.sleep(0.05)

    def kill_now(self) -> None:
        if self.pid is not None:
            process.signal_group(self.pid, signal.SIGKILL)


def progress_of(reply: dict[str, object]) -> ProgressReported | None:
    """The ``progress`` of a health answer (``types.WorkerProgress``), if it has a
    well-formed one; a role without steps reports none, and the watchdog leaves it be."""
    p = reply.get("progress")
    if not isinstance(p, dict):
        return None
    busy, stalled, steps = p.get("busy"), p.get("stalled_s"), p.get("steps")
    if (not isinstance(busy, bool) or isinstance(stalled, bool)
            or not isinstance(stalled, int | float) or isinstance(steps, bool)
            or not isinstance(steps, int)):
        log.warning("worker health answer has a malformed progress: %r", p)
        return None
    return ProgressReported(busy, float(stalled), steps)
