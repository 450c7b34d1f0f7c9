"""The worker lifecycle: a sans-IO state machine, one per supervised worker.

No IO, no clock and no randomness of its own (h11's ``_state.py``, aioquic's
``handle_timer(now)``): the runner feeds it events and the current time, and
carries out the actions it returns. It arms at most one timer at a time; the
runner sleeps until ``next_deadline()`` and then calls ``handle_timer(now)``.
Every state change returns exactly one ``Transitioned``, first in the list.

    EXITED/FAILED --start--> STARTING --ready--> RUNNING --(ran stably: backoff reset)
    STARTING --not ready within start_timeout_s--> KILL (a failure; each advance of its
               model's load or download, LoadAdvanced, counts that time again from then)
    STARTING/RUNNING --clean exit--> EXITED            (finished on its own)
    STARTING/RUNNING --failed exit--> BACKOFF --retry--> STARTING
    STARTING/RUNNING --failed exit--> FAILED           (too many exits in the flap window)
    STARTING/RUNNING --fatal exit--> FAILED            (kind "config": a restart cannot help)
    STARTING/RUNNING --stop--> STOPPING --exit--> EXITED (or STARTING if a start came meanwhile)
               (SIGTERM; SIGKILL at once when the stop says so, or on KillRequested:
               a worker group's restart, supervisor/groups.py)
    RUNNING --too many failed probes--> STOPPING --exit--> BACKOFF (a failure)
               (not counted for stop_timeout_s once a worker on its way out goes quiet:
               it said it is stopping, or it wrote its exit record and tears down)
    RUNNING --busy, no step for stall_timeout_s--> STOPPING --exit--> BACKOFF (the watchdog)

A failed exit is any exit that is not clean, a spawn failure, or any exit
after we killed the worker for a start timeout or failed health probes.
A fatal exit (``ExitCause.fatal``: the worker refused its options, or could not
load the model they name, exiting ``roles.options.EXIT_CONFIG`` with its exit
record's kind ``config``) is a failed exit that goes to FAILED at once: the same
start would fail the same way. ``mlxctl restart`` starts it again, once fixed.

The events it is fed and the actions it returns are in ``events.py``, with ``ExitCause``.
The whole lifecycle is the ``_TRANSITIONS`` table at the end of this module.
An event that has no row for the current state is ignored: ``handle`` returns
``[]`` and changes nothing. That covers late or duplicate reports from the
runner (a ``ProcessExited`` after the worker is already down) as well as
requests that are already satisfied (``StartRequested`` while RUNNING).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from mlxceld.supervisor.events import (
    NOT_RESTARTED,
    Action,
    AdoptedRunning,
    BecameReady,
    Event,
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
from mlxceld.types import WorkerState


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    backoff_jitter: float = 0.2  # +/- fraction of the delay
    stable_after_s: float = 30.0  # running this long resets the backoff exponent
    flap_max_exits: int = 5  # this many failed exits ...
    flap_window_s: float = 60.0  # ... within this window -> FAILED
    # not ready by then (or by then after its model load last advanced): kill it, a failure
    start_timeout_s: float = 30.0
    stop_timeout_s: float = 10.0  # STOPPING -> SIGKILL after this
    liveness_failures: int = 6  # consecutive failed health probes while RUNNING -> restart
    # The watchdog: a worker that reports work (``WorkerProgress.busy``) but no step for
    # this long is restarted; 0 turns it off. Checked at each health probe.
    stall_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "backoff_jitter":
                ok, rule = 0 <= value < 1, "be in [0, 1)"
            elif f.name in ("flap_max_exits", "liveness_failures"):
                ok, rule = type(value) is int and value >= 1, "be an integer >= 1"
            elif f.name == "stall_timeout_s":
                ok, rule = value >= 0, "be >= 0 (0: no watchdog)"
            elif f.name == "backoff_max_s":
                ok, rule = value >= self.backoff_initial_s, "be >= backoff_initial_s"
            else:
                ok, rule = value > 0, "be > 0"
            if not ok:
                raise ValueError(f"RestartPolicy.{f.name} must {rule}, got {value!r}")


# -- Timer events: handle_timer() feeds them through the same table ------------


@dataclass(frozen=True)
class _Timeout:
    """A timer armed in the current state fired."""


class _StartTimedOut(_Timeout): ...


class _RanStably(_Timeout): ...


class _StopTimedOut(_Timeout): ...


class _BackoffElapsed(_Timeout): ...


class Lifecycle:
    """The lifecycle of one worker. See the module docstring and ``_TRANSITIONS``."""

    def __init__(
        self,
        name: str,
        policy: RestartPolicy,
        random: Callable[[], float],
        *,
        restarts: int = 0,
    ) -> None:
        self.name = name
        self.policy = policy
        self._random = random
        self.restarts = restarts  # automatic restarts so far; the caller persists it
        self.state = WorkerState.EXITED
        self.pid: int | None = None
        self.last_cause: ExitCause | None = None
        self.reason = ""
        self.healthy = False
        self._timer: tuple[float, _Timeout] | None = None
        self._exits: list[float] = []  # times of recent failed exits (flap detection)
        self._streak = 0  # failed exits since the last stable period: the backoff exponent
        self._probe_failures = 0  # consecutive failed health probes
        self._leaving = False  # a probe found it on its way out (HealthProbed.stopping)
        self._quiet_since: float | None = None  # ... and since then, probes fail
        self._doomed = ""  # if set, the coming exit is a failure, for this reason
        self._doomed_kind = ""  # ... and of this kind (else the exit's own)
        self._start_pending = False  # a start was requested while STOPPING
        self._start_reason = ""  # ... and its reason
        self._stop_reason = ""  # why a requested stop was requested, if said
        self._load_advanced = False  # the start timer was re-armed by a load's progress

    @property
    def failing(self) -> str:
        """Why the coming exit is a failure (a STOPPING worker the health probes or the
        watchdog stopped, or a start that timed out); "" when it is not."""
        return self._doomed

    def __repr__(self) -> str:
        return f"<Lifecycle {self.name!r} {self.state} pid={self.pid} reason={self.reason!r}>"

    def handle(self, event: Event, now: float) -> list[Action]:
        """Feed one event at time ``now``; return the actions to carry out, in order."""
        return self._dispatch(event, now)

    def next_deadline(self) -> float | None:
        """When ``handle_timer`` must next be called, or None if no timer is armed."""
        return None if self._timer is None else self._timer[0]

    def handle_timer(self, now: float) -> list[Action]:
        """Fire the timer if it is due at ``now``; otherwise do nothing."""
        if self._timer is None or now < self._timer[0]:
            return []
        timeout = self._timer[1]
        self._timer = None
        return self._dispatch(timeout, now)

    def _dispatch(self, event: Event | _Timeout, now: float) -> list[Action]:
        handler = _TRANSITIONS.get((self.state, type(event)))
        return [] if handler is None else handler(self, event, now)

    # -- Helpers --------------------------------------------------------------

    def _enter(self, new: WorkerState, reason: str) -> list[Action]:
        old, self.state, self.reason = self.state, new, reason
        self.healthy = new is WorkerState.RUNNING
        self._timer = None  # every timer belongs to the state it was armed in
        self._doomed, self._doomed_kind = "", ""
        self._start_pending, self._probe_failures = False, 0
        self._leaving, self._quiet_since = False, None
        self._stop_reason = ""
        self._load_advanced = False
        return [Transitioned(old, new, reason)]

    def _reap(self, cause: ExitCause) -> None:
        self.pid, self.last_cause = None, cause

    def _spawn(self, now: float, reason: str) -> list[Action]:
        actions = self._enter(WorkerState.STARTING, reason)
        self._timer = (now + self.policy.start_timeout_s, _StartTimedOut())
        return [*actions, SpawnProcess()]

    def _run(self, now: float, reason: str) -> list[Action]:
        actions = self._enter(WorkerState.RUNNING, reason)
        self._timer = (now + self.policy.stable_after_s, _RanStably())
        return actions

    def _stop(self, now: float, reason: str) -> list[Action]:
        actions = self._enter(WorkerState.STOPPING, reason)
        self._timer = (now + self.policy.stop_timeout_s, _StopTimedOut())
        return [*actions, SendSignal("TERM")]

    def _fail(self, cause: ExitCause, now: float) -> list[Action]:
        """A failed exit: FAILED if it is fatal or flaps, else BACKOFF with an exponential
        delay."""
        self._reap(cause)
        if cause.fatal:
            # What to do next is the caller's to say: `mlxctl restart` once fixed
            # (supervisor/health.py), or a new plan (the assignment's stage host).
            return self._enter(WorkerState.FAILED, cause.summary + NOT_RESTARTED)
        p = self.policy
        self._exits = [t for t in self._exits if now - t <= p.flap_window_s] + [now]
        if len(self._exits) >= p.flap_max_exits:
            why = f"exited {len(self._exits)} times in {p.flap_window_s:g} s"
            return self._enter(WorkerState.FAILED, f"{why}; last: {cause.summary}")
        delay = min(p.backoff_max_s, p.backoff_initial_s * 2.0 ** min(self._streak, 1000))
        delay *= 1 + p.backoff_jitter * (2 * self._random() - 1)
        self._streak += 1
        actions = self._enter(
            WorkerState.BACKOFF, f"restarting in {delay:.1f} s after: {cause.summary}"
        )
        self._timer = (now + delay, _BackoffElapsed())
        return actions

    # -- Handlers: one per row of _TRANSITIONS ----------------------------------

    def _on_start(self, event: StartRequested, now: float) -> list[Action]:
        if self.state is WorkerState.FAILED:  # a manual start gives it a fresh chance
            self._exits, self._streak = [], 0
        return self._spawn(now, event.reason or "start requested")

    def _on_adopted(self, event: AdoptedRunning, now: float) -> list[Action]:
        self.pid = event.pid
        return self._run(now, f"adopted running process {event.pid}")

    def _on_spawned(self, event: Spawned, now: float) -> list[Action]:
        self.pid = event.pid
        return []

    def _on_spawned_while_stopping(self, event: Spawned, now: float) -> list[Action]:
        self.pid = event.pid  # the stop came before the pid: signal it now
        return [SendSignal("TERM")]

    def _on_spawn_failed(self, event: SpawnFailed, now: float) -> list[Action]:
        return self._dispatch(ProcessExited(ExitCause("spawn_failed", event.reason)), now)

    def _on_ready(self, event: BecameReady, now: float) -> list[Action]:
        return [] if self._doomed else self._run(now, "ready")

    def _on_start_timeout(self, event: _StartTimedOut, now: float) -> list[Action]:
        self._doomed = (f"did not become ready within {self.policy.start_timeout_s:g} s"
                        + (" of its model load's last progress" if self._load_advanced
                           else ""))
        return [SendSignal("KILL")]

    def _on_load_advanced(self, event: LoadAdvanced, now: float) -> list[Action]:
        if not self._doomed:
            self._timer = (now + self.policy.start_timeout_s, _StartTimedOut())
            self._load_advanced = True
        return []

    def _on_stable(self, event: _RanStably, now: float) -> list[Action]:
        self._streak = 0
        return []

    def _on_probe(self, event: HealthProbed, now: float) -> list[Action]:
        self._leaving = self._leaving or event.stopping
        if event.ok:
            if not self.healthy:
                self.reason = "health probe ok again"
            self._probe_failures, self.healthy = 0, True
            self._quiet_since = None
            return []
        self.healthy = False
        if self._leaving:  # quiet on its way out: let it exit
            return self._on_quiet_while_stopping(event, now)
        self._probe_failures += 1
        n, limit, last = self._probe_failures, self.policy.liveness_failures, event.reason
        if n < limit:
            self.reason = f"health probe failed ({n}/{limit}): {last}"
            return []
        doomed = f"failed {n} consecutive health probes (last: {last})"
        actions = self._stop(now, f"restarting: {doomed}")
        self._doomed = doomed
        return actions

    def _on_quiet_while_stopping(self, event: HealthProbed, now: float) -> list[Action]:
        """A worker on its way out (``HealthProbed.stopping``) answers no more: its exit
        is coming (the interpreter's teardown), and a clean one must read as finished,
        not as failed probes. It gets ``stop_timeout_s`` from the first failed probe, as
        a stop of ours would; then it is killed, a failure."""
        if self._quiet_since is None:
            self._quiet_since = now
        waited, limit = now - self._quiet_since, self.policy.stop_timeout_s
        if waited < limit:
            self.reason = (f"stopping on its own; its health probe fails ({event.reason}), "
                           f"so it has {limit:g} s (stop_timeout_s) to exit")
            return []
        doomed = (f"it was on its way out, then answered no health probe for {waited:.0f} s "
                  f"without exiting (stop_timeout_s {limit:g}; last: {event.reason})")
        actions = self._stop(now, f"restarting: {doomed}")
        self._doomed = doomed
        return actions

    def _on_progress(self, event: ProgressReported, now: float) -> list[Action]:
        limit = self.policy.stall_timeout_s
        if not event.busy or limit <= 0 or event.stalled_s < limit:
            return []
        doomed = (f"watchdog: it had work but made no progress for {event.stalled_s:.0f} s "
                  f"(stall_timeout_s {limit:g}; {event.steps} steps done)")
        actions = self._stop(now, f"restarting: {doomed}")
        self._doomed, self._doomed_kind = doomed, "watchdog"
        return actions

    def _doomed_cause(self, cause: ExitCause) -> ExitCause:
        return replace(cause, summary=self._doomed, kind=self._doomed_kind or cause.kind)

    def _on_exit(self, event: ProcessExited, now: float) -> list[Action]:
        if self._doomed:
            return self._fail(self._doomed_cause(event.cause), now)
        if not event.cause.clean:
            return self._fail(event.cause, now)
        self._reap(event.cause)
        return self._enter(WorkerState.EXITED, f"finished: {event.cause.summary}")

    def _on_stop(self, event: StopRequested, now: float) -> list[Action]:
        actions = self._stop(now, event.reason or "stop requested")
        self._stop_reason = event.reason
        if event.at_once:
            actions[-1] = SendSignal("KILL")
        elif event.within_s is not None:
            self._timer = (now + event.within_s, _StopTimedOut())
        return actions

    def _on_stop_while_stopping(self, event: StopRequested, now: float) -> list[Action]:
        self._doomed, self._doomed_kind = "", ""  # down it is: no restart after the exit
        self._start_pending = False
        return []

    def _on_start_while_stopping(self, event: StartRequested, now: float) -> list[Action]:
        self._start_pending, self._start_reason = True, event.reason
        return []

    def _on_stop_timeout(self, event: _StopTimedOut | KillRequested, now: float
                         ) -> list[Action]:
        return [SendSignal("KILL")]

    def _on_stopped(self, event: ProcessExited, now: float) -> list[Action]:
        if self._doomed:  # a liveness or watchdog restart: the exit is a failure
            return self._fail(self._doomed_cause(event.cause), now)
        self._reap(event.cause)
        if self._start_pending:
            return self._spawn(now, self._start_reason or "restart requested")
        return self._enter(WorkerState.EXITED, "stopped" + (f": {self._stop_reason}"
                                                            if self._stop_reason else ""))

    def _on_stop_in_backoff(self, event: StopRequested, now: float) -> list[Action]:
        return self._enter(WorkerState.EXITED, "stopped during backoff")

    def _on_retry(self, event: _BackoffElapsed, now: float) -> list[Action]:
        self.restarts += 1
        return self._spawn(now, f"automatic restart #{self.restarts}")


_Handler = Callable[[Lifecycle, Any, float], list[Action]]
_S = WorkerState

# (state, event) -> handler. A pair not listed is ignored: handle() returns [].
_TRANSITIONS: dict[tuple[WorkerState, type[object]], _Handler] = {
    (_S.EXITED, StartRequested): Lifecycle._on_start,  # -> STARTING
    (_S.EXITED, AdoptedRunning): Lifecycle._on_adopted,  # -> RUNNING
    (_S.FAILED, StartRequested): Lifecycle._on_start,  # -> STARTING, flap history cleared
    (_S.STARTING, Spawned): Lifecycle._on_spawned,
    (_S.STARTING, SpawnFailed): Lifecycle._on_spawn_failed,  # as a failed ProcessExited
    (_S.STARTING, BecameReady): Lifecycle._on_ready,  # -> RUNNING
    (_S.STARTING, _StartTimedOut): Lifecycle._on_start_timeout,  # KILL; its exit is a failure
    (_S.STARTING, LoadAdvanced): Lifecycle._on_load_advanced,  # the start timer again
    (_S.STARTING, ProcessExited): Lifecycle._on_exit,  # -> EXITED | BACKOFF | FAILED
    (_S.STARTING, StopRequested): Lifecycle._on_stop,  # -> STOPPING
    (_S.RUNNING, _RanStably): Lifecycle._on_stable,  # backoff exponent reset
    (_S.RUNNING, HealthProbed): Lifecycle._on_probe,  # -> STOPPING after too many failures
    (_S.RUNNING, ProgressReported): Lifecycle._on_progress,  # -> STOPPING if stalled
    (_S.RUNNING, ProcessExited): Lifecycle._on_exit,  # -> EXITED | BACKOFF | FAILED
    (_S.RUNNING, StopRequested): Lifecycle._on_stop,  # -> STOPPING
    (_S.STOPPING, Spawned): Lifecycle._on_spawned_while_stopping,  # TERM the new pid
    (_S.STOPPING, SpawnFailed): Lifecycle._on_spawn_failed,  # as a ProcessExited
    (_S.STOPPING, StartRequested): Lifecycle._on_start_while_stopping,  # restart after the exit
    (_S.STOPPING, StopRequested): Lifecycle._on_stop_while_stopping,  # cancels any restart
    (_S.STOPPING, _StopTimedOut): Lifecycle._on_stop_timeout,  # KILL, once
    (_S.STOPPING, KillRequested): Lifecycle._on_stop_timeout,  # KILL now
    (_S.STOPPING, ProcessExited): Lifecycle._on_stopped,  # -> EXITED | STARTING | BACKOFF
    (_S.BACKOFF, _BackoffElapsed): Lifecycle._on_retry,  # -> STARTING, restarts += 1
    (_S.BACKOFF, StopRequested): Lifecycle._on_stop_in_backoff,  # -> EXITED
}
