"""The supervisor: all of a daemon's worker runners, their persistence and their logs.

It owns one TaskGroup for every runner's tasks. Transitions are written to the
``workers`` table and the ``events`` log as they happen, so a daemon that is
killed comes back to the same desired state and can re-adopt what still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxceld.errors import ChannelError, WorkerError
from mlxceld.state import EventLog, WorkerRow, WorkersTable
from mlxceld.supervisor import channel, logfiles, process
from mlxceld.supervisor.events import (
    KillRequested,
    LoadAdvanced,
    StartRequested,
    StopRequested,
    Transitioned,
)
from mlxceld.supervisor.groups import GROUP_STOP_S, UP, group_rule
from mlxceld.supervisor.ops import Stats, WorkerRequest
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.runner import WorkerRunner
from mlxceld.supervisor.states import Lifecycle
from mlxceld.supervisor.views import WorkerView
from mlxceld.tasks import cancelling_group
from mlxceld.types import JSON, LoadProgress, WorkerKeys, WorkerState, load_progress

log = logging.getLogger(__name__)

REMOVED_STOP_TIMEOUT_S = 10.0
ASKED_STATS = frozenset({WorkerState.RUNNING, WorkerState.STARTING})  # by stats()
STARTING = frozenset({WorkerState.STARTING})
STATS_TIMEOUT_S = 0.5  # a running worker that does not answer ``stats`` within this is left out
LOADS_EVERY_S = 2.0  # between two asks of the starting workers' loads (systemd's STATUS line)


# (the worker's spec, its new state or None once removed, the reason)
Changed = Callable[[WorkerSpec, WorkerState | None, str], None]


class Supervisor:
    def __init__(self, workers: WorkersTable, events: EventLog, *, health_interval_s: float,
                 log_max_bytes: int, log_backups: int,
                 rand: Callable[[], float] = random.random,
                 finished: Callable[[str], None] | None = None,
                 changed: Changed | None = None) -> None:
        """``finished``: told the name of a worker that exited cleanly on its own (not
        stopped by us), which stays down unless its owner starts it again; ``changed``:
        told each worker's every transition (its spec, new state and reason) as it is
        recorded, before any action that follows it (a spawn), and its removal (state
        None). Both are called on the event loop and must not block."""
        self._table = workers
        self._finished = finished
        self._changed = changed
        self._events = events
        self._health_interval_s = health_interval_s
        self._log_max_bytes = log_max_bytes
        self._log_backups = log_backups
        self._rand = rand
        self._runners: dict[str, WorkerRunner] = {}
        # A starting worker's load, as the last one to ask it saw it (note_loading).
        self._loading: dict[str, LoadProgress] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._closing = asyncio.Event()

    # -- lifetime -------------------------------------------------------------------------

    async def run(self, started: asyncio.Future[None]) -> None:
        """Own every runner task until ``close`` (then they are cancelled); ``started``
        resolves once tasks can be made."""
        async with cancelling_group() as tg:
            self._tg = tg
            self._spawn_task(logfiles.rotate_forever(
                lambda: [(r.name, r.spec.log_path) for r in list(self._runners.values())],
                self._log_max_bytes, self._log_backups))
            self._spawn_task(self._watch_loads())
            started.set_result(None)
            await self._closing.wait()
        self._tg = None

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._tg is not None, "supervisor is not running"
        return self._tg.create_task(coro)

    def close(self) -> None:
        self._closing.set()

    # -- workers --------------------------------------------------------------------------

    async def reconcile(self, specs: list[WorkerSpec]) -> None:
        """Make the running set match ``specs``: adopt survivors, start the rest, stop leftovers."""
        wanted = {s.name: s for s in specs}
        before = {name: r.spec.group for name, r in self._runners.items()}
        for row in self._table.all():
            if row.name not in wanted and row.name not in self._runners:
                await self._retire_leftover(row)
        for name in list(self._runners):
            if name not in wanted:
                await self.remove(name)
        for spec in specs:
            runner = self._runners.get(spec.name)
            if runner is None:
                await self._add(spec)
            elif replace(spec, secret=runner.spec.secret, accepted=runner.spec.accepted,
                         api_key=runner.spec.api_key) == runner.spec:
                # At most the keyring (push_keyring carries that live) or the API key.
                new_key = spec.api_key != runner.spec.api_key
                runner.spec = spec
                if new_key:
                    await self._new_api_key(runner)
            elif spec != runner.spec:
                # Never a restart on reload: the new spec and policy apply from the next start.
                runner.spec = spec
                runner.machine.policy = spec.policy
                self._table.update(spec.name, role=spec.role, spec=spec.describe())
                self._events.append("worker.config_changed", spec.name,
                                    f"worker {spec.name}: new spec takes effect at its next start")
        self._regroup(before, specs)

    async def _new_api_key(self, runner: WorkerRunner) -> None:
        """A reload read a new API key: the worker takes it now, live (or at its next
        health probe, where this fails), and at its next start from its spec."""
        self._table.update(runner.name, role=runner.spec.role, spec=runner.spec.describe())
        try:
            await runner.push_api_key()
        except WorkerError as exc:
            log.warning("%s", exc.message)

    def _regroup(self, before: dict[str, str | None], specs: list[WorkerSpec]) -> None:
        """A group whose members changed (a reload's new ``tp_size``) restarts the workers
        that were there before and still are, in it before or now (the router leaving
        or joining a group): their ring no longer matches its ranks (``groups.py``).
        Added workers start as any; removed ones were stopped."""
        still = set(before) & {s.name for s in specs}
        for group in {g for g in (*before.values(), *(s.group for s in specs)) if g}:
            old = {n for n, g in before.items() if g == group}
            new = {s.name for s in specs if s.group == group}
            kept = sorted((old | new) & still)
            if old == new or not kept:
                continue
            now = ", ".join(sorted(new)) or "none"
            reason = (f"group {group}: its members changed (now {now}); its group restarts "
                      "together")
            log.info("%s", reason)
            self._events.append("worker.group_restart", group, reason, group=group,
                                members=kept)
            for name in kept:
                self._restart(name, reason)

    async def _add(self, spec: WorkerSpec) -> None:
        row = self._table.get(spec.name)
        machine = Lifecycle(spec.name, spec.policy, self._rand,
                            restarts=row.restarts if row else 0)
        runner = WorkerRunner(spec, machine, self, self._spawn_task, self._health_interval_s)
        self._runners[spec.name] = runner
        desired = row.desired if row else "running"
        self._table.put(spec.name, role=spec.role, spec=spec.describe(), desired=desired,
                        state=machine.state.value, restarts=machine.restarts)
        self._spawn_task(runner.drive())
        if row and row.pid and row.create_time:
            if await process.confirm_adoptable(spec, row.pid, row.create_time):
                log.info("worker %s: re-adopted pid %d", spec.name, row.pid)
                self._events.append("worker.adopted", spec.name,
                                    f"worker {spec.name} re-adopted (pid {row.pid})",
                                    pid=row.pid)
                # Its uptime goes on: since it ran, as the row says for this very process.
                since = (row.started_at if row.started_at and row.started_at >= row.create_time
                         else row.create_time)
                runner.adopt(row.pid, row.create_time, since)
                return
            if process.is_same_process(row.pid, row.create_time):
                self._events.append("worker.unresponsive", spec.name,
                                    f"worker {spec.name} (pid {row.pid}) survived the daemon but "
                                    "does not answer its channel; killing it", pid=row.pid)
                process.signal_group(row.pid, signal.SIGKILL)
        if desired == "running":
            runner.post(StartRequested())

    async def _retire_leftover(self, row: WorkerRow) -> None:
        """A worker in the database but no longer configured: stop it if it still runs."""
        if row.pid and process.is_same_process(row.pid, row.create_time):
            process.signal_group(row.pid, signal.SIGTERM)
            deadline = time.monotonic() + REMOVED_STOP_TIMEOUT_S
            while process.is_same_process(row.pid, row.create_time):
                if time.monotonic() > deadline:
                    process.signal_group(row.pid, signal.SIGKILL)
                    break
                await asyncio.sleep(0.05)
        self._table.delete(row.name)
        self._events.append("worker.removed", row.name,
                            f"worker {row.name} is no longer configured; removed")

    async def remove(self, name: str, reason: str = "", *,
                     within_s: float | None = None) -> None:
        """Stop ``name`` and forget it. ``reason``: why, for its STOPPING state and the
        event (else: removed from the config); ``within_s``: SIGKILL this long after
        SIGTERM rather than at its stop timeout (a process whose work is known lost: a
        tensor stage waiting in a ring that moved, ``daemon/stage_peers.py``)."""
        runner = self._runners[name]
        runner.post(StopRequested(reason, within_s=within_s))
        await runner.wait_stopped()
        del self._runners[name]
        self._loading.pop(name, None)
        self._table.delete(name)
        self._events.append("worker.removed", name, f"worker {name} removed "
                            + (f"({reason})" if reason else "from the config"))
        self._tell(runner.spec, None, "removed")

    def rename(self, name: str, to: str) -> WorkerSpec:
        """Worker ``name``'s process goes on as ``to`` (no worker has that name), and
        ``name`` is free for another: a stage the next plan replaces, kept serving until
        that plan serves, or named back if it does not (``cluster/assignment/
        stagehost.py``). Its control socket and log file move with it (the process keeps
        them open). Returns its spec under the new name."""
        runner = self._runners.pop(name)
        old, new = runner.spec, replace(runner.spec, name=to)
        for a, b in ((old.control_socket, new.control_socket), (old.log_path, new.log_path)):
            with contextlib.suppress(FileNotFoundError):
                os.replace(a, b)
        runner.spec = new
        self._runners[to] = runner
        self._loading.pop(name, None)
        row = self._table.get(name)
        self._table.delete(name)
        m = runner.machine
        self._table.put(to, role=new.role, spec=new.describe(), desired="running",
                        state=m.state.value, restarts=m.restarts, pid=runner.pid,
                        create_time=runner.create_time,
                        started_at=row.started_at if row else None)
        self._events.append("worker.renamed", to, f"worker {name} (pid {runner.pid}) goes on "
                            f"as {to}", was=name, pid=runner.pid)
        log.info("worker %s (pid %s) goes on as %s", name, runner.pid, to)
        return new

    def restart(self, name: str) -> None:
        """Stop (if running) and start again; also the way out of FAILED. A member of a
        group (``WorkerSpec.group``) restarts with all its group (``groups.py``)."""
        group = self._runners[name].spec.group
        for member in self._members(group) if group is not None else [name]:
            self._restart(member, f"restart of {name} requested")

    def _restart(self, name: str, reason: str = "", *, within_s: float | None = None) -> None:
        runner = self._runners[name]
        self._table.update(name, desired="running")
        if runner.machine.state in UP:
            runner.post(StopRequested(reason, within_s=within_s))
        runner.post(StartRequested(reason))
        self._events.append("worker.restart_requested", name,
                            reason or f"restart of {name} requested")

    def _members(self, group: str) -> list[str]:
        return [n for n, r in sorted(self._runners.items()) if r.spec.group == group]

    def longest_stop_timeout(self) -> float:
        return max((r.spec.policy.stop_timeout_s for r in self._runners.values()), default=0.0)

    async def push_keyring(self, primary: bytes, accepted: Sequence[bytes]) -> dict[str, str]:
        """Give every worker that holds the cluster secret this keyring: its spec (for the
        next start) and, running, over its control channel, all at once (each within the
        runner's ``LIVENESS_TIMEOUT_S``). What failed, by worker (a failed one is sent its
        keyring again at its next health probe)."""
        holders = [r for r in self._runners.values() if r.spec.secret is not None]
        for r in holders:
            r.spec = replace(r.spec, secret=primary, accepted=tuple(accepted))

        async def push(runner: WorkerRunner) -> str | None:
            try:
                await runner.push_keys()
            except WorkerError as exc:
                return exc.message
            return None

        answers = await asyncio.gather(*(push(r) for r in holders))
        return {r.name: a for r, a in zip(holders, answers, strict=True) if a is not None}

    async def streams_under(self, kid: str) -> dict[str, int]:
        """Each worker holding the cluster secret that has open streams under key id
        ``kid``: how many (a worker that does not answer is left out: it is told its
        keyring again at its next health probe)."""
        holders = [r for r in self._runners.values() if r.spec.secret is not None]

        async def count(runner: WorkerRunner) -> int:
            try:
                return await runner.streams_under(kid)
            except WorkerError:
                return 0

        answers = await asyncio.gather(*(count(r) for r in holders))
        return {r.name: n for r, n in zip(holders, answers, strict=True) if n}

    def worker_keys(self) -> dict[str, WorkerKeys | None]:
        """Each worker holding the cluster secret: its key ids as it last reported them."""
        return {name: r.keys for name, r in sorted(self._runners.items())
                if r.spec.secret is not None}

    def names(self) -> list[str]:
        return sorted(self._runners)

    async def stop_all(self) -> None:
        """Ask every worker to stop; each gets its own stop timeout before SIGKILL."""
        for runner in self._runners.values():
            runner.post(StopRequested())
        await asyncio.gather(*(r.wait_stopped() for r in self._runners.values()))

    def kill_all(self) -> None:
        for runner in self._runners.values():
            runner.kill_now()

    # -- Observer -------------------------------------------------------------------------

    def transitioned(self, runner: WorkerRunner, change: Transitioned) -> None:
        m = runner.machine
        fields: dict[str, Any] = {"state": change.new.value, "reason": change.reason,
                                  "restarts": m.restarts, "pid": runner.pid,
                                  "create_time": runner.create_time}
        if change.new in (WorkerState.BACKOFF, WorkerState.EXITED, WorkerState.FAILED) \
                and m.last_cause is not None:
            fields["last_exit"] = m.last_cause.summary
            fields["last_exit_at"] = time.time()
        if change.new is WorkerState.RUNNING:
            fields["started_at"] = runner.adopted_since or time.time()
        self._table.update(runner.name, **fields)
        level = logging.WARNING if change.new is WorkerState.FAILED else logging.INFO
        log.log(level, "worker %s: %s -> %s (%s)", runner.name, change.old.value,
                change.new.value, change.reason)
        self._events.append(f"worker.{change.new.value}", runner.name,
                            f"worker {runner.name}: {change.old.value} -> {change.new.value}"
                            + (f": {change.reason}" if change.reason else ""),
                            old=change.old.value, new=change.new.value, reason=change.reason,
                            pid=runner.pid,
                            cause=m.last_cause.kind if m.last_cause else None)
        self._tell(runner.spec, change.new, change.reason or "")

        if runner.spec.group is not None:
            self._group_rule(runner, change)
        if (self._finished is not None and change.new is WorkerState.EXITED
                and change.old in (WorkerState.RUNNING, WorkerState.STARTING)
                and m.last_cause is not None and m.last_cause.clean):
            self._finished(runner.name)

    def _group_rule(self, runner: WorkerRunner, change: Transitioned) -> None:
        """The rest of ``runner``'s group restarted or stopped, as its transition asks
        (``groups.py``): each member that is RUNNING or STARTING."""
        group, m = runner.spec.group, runner.machine
        assert group is not None
        action = group_rule(group, runner.name, change.old, change.new, change.reason,
                            exit_summary=m.last_cause.summary if m.last_cause else None,
                            failing=m.failing)
        if action is None:
            return
        others = [n for n in self._members(group)
                  if n != runner.name and self._runners[n].machine.state in UP]
        if not others:  # the rest is down or going (a stop of all, as at unserve): as asked
            return
        log.warning("%s (%s)", action.reason, ", ".join(others))
        self._events.append(f"worker.group_{action.kind}", runner.name, action.reason,
                            group=group, members=others)
        if change.new is WorkerState.STOPPING:  # failed probes or the watchdog: hung
            runner.post(KillRequested())
        for name in others:  # their collectives wait on it: nothing of theirs can drain
            if action.kind == "restart":
                self._restart(name, action.reason, within_s=GROUP_STOP_S)
            else:
                self._runners[name].post(StopRequested(action.reason, within_s=GROUP_STOP_S))

    def _tell(self, spec: WorkerSpec, state: WorkerState | None, reason: str) -> None:
        """``changed``, whose failure is logged: it never stops a worker's lifecycle."""
        if self._changed is None:
            return
        try:
            self._changed(spec, state, reason)
        except Exception:
            log.exception("worker %s: what follows its change to %s failed", spec.name,
                          state.value if state else "removed")

    def spawned(self, runner: WorkerRunner) -> None:
        self._table.update(runner.name, pid=runner.pid, create_time=runner.create_time)
        self._events.append("worker.spawned", runner.name,
                            f"worker {runner.name} started as pid {runner.pid}", pid=runner.pid)

    # -- views ----------------------------------------------------------------------------

    def snapshot(self) -> list[WorkerView]:
        out = []
        for name in sorted(self._runners):
            r = self._runners[name]
            row = self._table.get(name)
            m = r.machine
            loading = self._loading.get(name)
            out.append(WorkerView(
                name=name, role=r.spec.role, group=r.spec.group, state=m.state, pid=r.pid,
                healthy=m.healthy if m.state is WorkerState.RUNNING else None,
                reason=m.reason, restarts=m.restarts,
                last_exit=m.last_cause.summary if m.last_cause else (row.last_exit if row
                                                                     else ""),
                started_at=row.started_at if row else None, rss_bytes=process.rss_bytes(r.pid),
                log=str(r.spec.log_path), keys=r.keys,
                loading=loading if m.state is WorkerState.STARTING else None))
        return out

    def note_loading(self, name: str, progress: LoadProgress | None) -> None:
        """What worker ``name`` said of its load (its ``loading`` stat), for ``snapshot``
        (and so systemd's STATUS line) while it starts; None: it has loaded."""
        if progress is None:
            self._loading.pop(name, None)
            return
        before = self._loading.get(name)
        self._loading[name] = progress
        runner = self._runners.get(name)
        if runner is not None and (before is None or _reach(progress) > _reach(before)):
            runner.post(LoadAdvanced())  # its start timeout counts from now (states.py)

    async def stats(self, states: frozenset[WorkerState] = ASKED_STATS) -> dict[str, JSON]:
        """Each running or starting worker's own stats (its control channel's ``stats`` op:
        a stage or router loading its weights says how far it is), asked all at once; a
        worker that does not answer within ``STATS_TIMEOUT_S`` is left out. ``states``:
        only the workers in these."""
        running = [(name, r) for name, r in sorted(self._runners.items())
                   if r.machine.state in states and r.pid is not None]

        async def ask(runner: WorkerRunner) -> JSON | None:
            try:
                reply = await channel.call(runner.spec.control_socket, Stats(),
                                           timeout_s=STATS_TIMEOUT_S)
            except WorkerError:
                return None
            stats = reply.get("stats")
            return stats if isinstance(stats, dict) else None

        answers = await asyncio.gather(*(ask(r) for _, r in running))
        return {name: a for (name, _), a in zip(running, answers, strict=True) if a is not None}

    def state(self, name: str) -> tuple[WorkerState, str] | None:
        """Worker ``name``'s lifecycle state and its reason; None if there is no such worker."""
        r = self._runners.get(name)
        return None if r is None else (r.machine.state, r.machine.reason)

    def log_path(self, name: str) -> str | None:
        r = self._runners.get(name)
        return str(r.spec.log_path) if r else None

    def control_socket(self, name: str) -> Path | None:
        r = self._runners.get(name)
        return r.spec.control_socket if r else None

    async def call_running(self, name: str, request: WorkerRequest) -> JSON | None:
        """Worker ``name``'s answer to ``request`` (``ops.py``), if it is running; None if
        it is not, or did not answer within the channel's deadline (logged at debug)."""
        r = self._runners.get(name)
        if r is None or r.machine.state is not WorkerState.RUNNING:
            return None
        try:
            return await channel.call(r.spec.control_socket, request)
        except ChannelError as exc:
            log.debug("worker %s did not take %s: %s", name, request.OP, exc)
            return None

    async def _watch_loads(self) -> None:
        """Every ``LOADS_EVERY_S``, each starting worker's ``loading`` stat (a router or a
        stage reading its weights: ``types.LoadProgress``), noted for ``snapshot`` and so
        for systemd's STATUS line; each ask bounded by ``STATS_TIMEOUT_S``. A stage host's
        assignment notes it too, as often as it asks (``stagehost.py``)."""
        while True:
            await asyncio.sleep(LOADS_EVERY_S)
            starting = {name for name, r in self._runners.items()
                        if r.machine.state is WorkerState.STARTING and r.pid is not None}
            for name in set(self._loading) - starting:
                self._loading.pop(name, None)
            if not starting:
                continue
            stats = await self.stats(STARTING)
            for name, answer in stats.items():  # one that did not answer keeps its last
                self.note_loading(name, load_progress(answer.get("loading")))


def _reach(p: LoadProgress) -> tuple[int, int]:
    """How far a load has come, in the order it goes: downloading, then loading; bytes."""
    return int(p.get("step") != "downloading"), p["done"]
