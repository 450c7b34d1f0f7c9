"""The worker lifecycle, driven by hand: events in, actions out, time passed explicitly."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxceld.supervisor import (
    Action,
    AdoptedRunning,
    BecameReady,
    Event,
    ExitCause,
    HealthProbed,
    Lifecycle,
    LoadAdvanced,
    ProcessExited,
    ProgressReported,
    RestartPolicy,
    SendSignal,
    Spawned,
    SpawnFailed,
    SpawnProcess,
    StartRequested,
    StopRequested,
    Transitioned,
    WorkerState,
)

S = WorkerState
CLEAN = ExitCause("clean", "exited with status 0", 0)
CRASH = ExitCause("signal", "killed by SIGSEGV", -11)
OOM = ExitCause("oom", "killed by SIGKILL (likely out of memory)", -9)
NO_FLAP = {"flap_max_exits": 1000}


def make(random: float = 0.5, *, restarts: int = 0, **policy: Any) -> Lifecycle:
    """random=0.5 makes the jitter factor exactly 1."""
    return Lifecycle("stage-0", RestartPolicy(**policy), lambda: random, restarts=restarts)


def starting(lc: Lifecycle, now: float = 0.0, pid: int = 100) -> None:
    lc.handle(StartRequested(), now)
    lc.handle(Spawned(pid), now)


def running(lc: Lifecycle, now: float = 0.0, pid: int = 100) -> None:
    starting(lc, now, pid)
    lc.handle(BecameReady(), now)
    assert lc.state is S.RUNNING


def crash(lc: Lifecycle, now: float, cause: ExitCause = CRASH) -> list[Action]:
    return lc.handle(ProcessExited(cause), now)


def backoff_delays(lc: Lifecycle, count: int) -> list[float]:
    """Crash the worker while STARTING ``count`` times; return each backoff delay."""
    delays, now = [], 0.0
    lc.handle(StartRequested(), now)
    for _ in range(count):
        crash(lc, now)
        deadline = lc.next_deadline()
        assert lc.state is S.BACKOFF and deadline is not None
        delays.append(deadline - now)
        now = deadline
        lc.handle_timer(now)
    return delays


# -- RestartPolicy and ExitCause ------------------------------------------------


def test_policy_defaults() -> None:
    p = RestartPolicy()
    assert (p.backoff_initial_s, p.backoff_max_s, p.backoff_jitter) == (1.0, 60.0, 0.2)
    assert (p.flap_max_exits, p.flap_window_s, p.liveness_failures) == (5, 60.0, 6)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backoff_initial_s", 0.0),
        ("backoff_max_s", -1.0),
        ("backoff_max_s", 0.5),  # below backoff_initial_s
        ("backoff_jitter", 1.0),
        ("backoff_jitter", -0.1),
        ("stable_after_s", float("nan")),
        ("flap_max_exits", 0),
        ("flap_max_exits", 2.5),
        ("flap_window_s", 0.0),
        ("start_timeout_s", -3.0),
        ("stop_timeout_s", 0.0),
        ("liveness_failures", 0),
        ("stall_timeout_s", -1.0),
    ],
)
def test_policy_rejects_bad_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"RestartPolicy.{field} must"):
        RestartPolicy(**{field: value})  # type: ignore[arg-type]


def test_policy_allows_zero_jitter() -> None:
    assert RestartPolicy(backoff_jitter=0.0).backoff_jitter == 0.0


def test_exit_cause_clean() -> None:
    assert CLEAN.clean
    assert not CRASH.clean
    assert not ExitCause("status", "exited with status 0?").clean


# -- Starting and running -------------------------------------------------------


def test_initial_state() -> None:
    lc = make()
    assert (lc.state, lc.reason, lc.pid, lc.last_cause) == (S.EXITED, "", None, None)
    assert (lc.restarts, lc.healthy, lc.next_deadline()) == (0, False, None)


def test_start_from_exited_spawns_and_arms_start_timeout() -> None:
    lc = make()
    actions = lc.handle(StartRequested(), 10.0)
    assert actions == [Transitioned(S.EXITED, S.STARTING, "start requested"), SpawnProcess()]
    assert lc.state is S.STARTING
    assert lc.next_deadline() == 40.0


def test_spawned_records_pid_without_transition() -> None:
    lc = make()
    lc.handle(StartRequested(), 0.0)
    assert lc.handle(Spawned(4242), 1.0) == []
    assert (lc.state, lc.pid) == (S.STARTING, 4242)


def test_ready_goes_running_and_arms_stable_timer() -> None:
    lc = make()
    starting(lc, 0.0)
    actions = lc.handle(BecameReady(), 5.0)
    assert actions == [Transitioned(S.STARTING, S.RUNNING, "ready")]
    assert (lc.state, lc.healthy, lc.pid) == (S.RUNNING, True, 100)
    assert lc.next_deadline() == 35.0


def test_adopt_running_worker_without_spawning() -> None:
    lc = make(restarts=3)
    actions = lc.handle(AdoptedRunning(777), 50.0)
    assert actions == [Transitioned(S.EXITED, S.RUNNING, "adopted running process 777")]
    assert (lc.state, lc.pid, lc.healthy, lc.restarts) == (S.RUNNING, 777, True, 3)
    assert lc.next_deadline() == 80.0


@pytest.mark.parametrize("state", [S.STARTING, S.RUNNING, S.BACKOFF])
def test_start_requested_when_already_going_is_a_no_op(state: WorkerState) -> None:
    lc = make()
    starting(lc)
    if state is S.RUNNING:
        lc.handle(BecameReady(), 0.0)
    if state is S.BACKOFF:
        crash(lc, 1.0)
    assert lc.state is state
    deadline = lc.next_deadline()
    assert lc.handle(StartRequested(), 2.0) == []
    assert (lc.state, lc.next_deadline()) == (state, deadline)


@pytest.mark.parametrize(
    "event",
    [
        ProcessExited(CRASH),
        BecameReady(),
        Spawned(1),
        HealthProbed(ok=False),
        SpawnFailed("nope"),
        StopRequested(),
    ],
)
def test_events_that_do_not_apply_in_exited_are_ignored(event: Event) -> None:
    lc = make()
    assert lc.handle(event, 1.0) == []
    assert (lc.state, lc.pid, lc.reason, lc.next_deadline()) == (S.EXITED, None, "", None)


def test_other_ignored_pairs() -> None:
    lc = make()
    starting(lc)
    assert lc.handle(HealthProbed(ok=False, reason="x"), 1.0) == []  # probes count while RUNNING
    assert lc.handle(AdoptedRunning(5), 1.0) == []
    lc.handle(BecameReady(), 1.0)
    assert lc.handle(BecameReady(), 2.0) == []
    assert lc.handle(Spawned(9), 2.0) == []
    assert (lc.state, lc.pid) == (S.RUNNING, 100)


# -- Exits ----------------------------------------------------------------------


@pytest.mark.parametrize("ready", [False, True])
def test_clean_exit_finishes_without_restart(ready: bool) -> None:
    lc = make()
    starting(lc)
    if ready:
        lc.handle(BecameReady(), 1.0)
    old = lc.state
    actions = crash(lc, 2.0, CLEAN)
    assert actions == [Transitioned(old, S.EXITED, "finished: exited with status 0")]
    assert (lc.pid, lc.last_cause, lc.next_deadline(), lc.healthy) == (None, CLEAN, None, False)


@pytest.mark.parametrize("ready", [False, True])
def test_failed_exit_backs_off(ready: bool) -> None:
    lc = make()
    starting(lc)
    if ready:
        lc.handle(BecameReady(), 1.0)
    old = lc.state
    actions = crash(lc, 10.0, OOM)
    reason = "restarting in 1.0 s after: killed by SIGKILL (likely out of memory)"
    assert actions == [Transitioned(old, S.BACKOFF, reason)]
    assert (lc.state, lc.reason, lc.pid, lc.last_cause) == (S.BACKOFF, reason, None, OOM)
    assert lc.next_deadline() == 11.0


def test_backoff_retry_restarts() -> None:
    lc = make()
    starting(lc)
    crash(lc, 10.0)
    assert lc.handle_timer(10.5) == []  # not due yet
    actions = lc.handle_timer(11.0)
    assert actions == [Transitioned(S.BACKOFF, S.STARTING, "automatic restart #1"), SpawnProcess()]
    assert (lc.restarts, lc.pid, lc.next_deadline()) == (1, None, 41.0)


def test_restore_keeps_counting_restarts() -> None:
    lc = make(restarts=7)
    starting(lc)
    crash(lc, 1.0)
    lc.handle_timer(2.0)
    assert lc.restarts == 8
    assert lc.reason == "automatic restart #8"


def test_spawn_failed_is_a_failed_exit() -> None:
    lc = make()
    lc.handle(StartRequested(), 0.0)
    actions = lc.handle(SpawnFailed("exec: no such file: /usr/bin/mlx-worker"), 1.0)
    reason = "restarting in 1.0 s after: exec: no such file: /usr/bin/mlx-worker"
    assert actions == [Transitioned(S.STARTING, S.BACKOFF, reason)]
    assert lc.last_cause == ExitCause("spawn_failed", "exec: no such file: /usr/bin/mlx-worker")


def test_backoff_doubles_and_caps() -> None:
    lc = make(backoff_initial_s=1.0, backoff_max_s=10.0, **NO_FLAP)
    assert backoff_delays(lc, 6) == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert lc.restarts == 6


@pytest.mark.parametrize(("random", "factor"), [(0.0, 0.8), (0.5, 1.0), (0.999, 1.1996)])
def test_jitter_bounds(random: float, factor: float) -> None:
    lc = make(random, backoff_initial_s=2.0, backoff_max_s=5.0, **NO_FLAP)
    delays = backoff_delays(lc, 3)
    assert delays == pytest.approx([2.0 * factor, 4.0 * factor, 5.0 * factor])
    assert all(0.8 * d <= got < 1.2 * d for d, got in zip([2.0, 4.0, 5.0], delays, strict=True))


def test_jitter_shows_in_the_reason() -> None:
    lc = make(0.0)
    starting(lc)
    crash(lc, 0.0)
    assert lc.reason == "restarting in 0.8 s after: killed by SIGSEGV"


def test_many_failures_never_overflow() -> None:
    lc = make(backoff_initial_s=1.0, backoff_max_s=2.0, **NO_FLAP)
    assert backoff_delays(lc, 1200)[-1] == 2.0


def test_stable_period_resets_backoff_exponent() -> None:
    lc = make(**NO_FLAP)
    starting(lc)
    crash(lc, 0.0)  # delay 1
    lc.handle_timer(1.0)
    crash(lc, 1.0)  # delay 2
    lc.handle_timer(3.0)
    lc.handle(BecameReady(), 3.0)
    assert lc.next_deadline() == 33.0
    assert lc.handle_timer(32.9) == []
    assert lc.handle_timer(33.0) == []  # fires: no transition, no actions
    assert (lc.state, lc.next_deadline()) == (S.RUNNING, None)
    crash(lc, 40.0)
    assert lc.next_deadline() == 41.0  # back to the initial delay


def test_exit_before_stable_period_keeps_doubling() -> None:
    lc = make(**NO_FLAP)
    running(lc)
    crash(lc, 29.0)  # delay 1
    lc.handle_timer(30.0)
    lc.handle(BecameReady(), 30.0)
    crash(lc, 59.0)
    assert lc.next_deadline() == 61.0


def test_flapping_fails_with_reason() -> None:
    lc = make()
    assert backoff_delays(lc, 4) == [1.0, 2.0, 4.0, 8.0]
    assert lc.state is S.STARTING
    actions = crash(lc, 15.0, OOM)  # five exits between 0 s and 15 s
    reason = "exited 5 times in 60 s; last: killed by SIGKILL (likely out of memory)"
    assert actions == [Transitioned(S.STARTING, S.FAILED, reason)]
    assert (lc.state, lc.reason, lc.pid, lc.next_deadline()) == (S.FAILED, reason, None, None)


@pytest.mark.parametrize("ready", [False, True])
def test_a_config_exit_fails_at_once_and_is_not_restarted(ready: bool) -> None:
    # A stage that cannot load its model (runtime.py: EXIT_CONFIG, kind "config"): the
    # same start would fail the same way, so FAILED with its reason, no backoff, no timer.
    lc = make()
    starting(lc)
    if ready:
        lc.handle(BecameReady(), 1.0)
    cause = ExitCause("config", "stage stage-0 failed to load layers [0, 2)", 2)
    assert cause.fatal and not CRASH.fatal and not OOM.fatal
    actions = crash(lc, 2.0, cause)
    assert [type(a) for a in actions] == [Transitioned] and actions[0].new is S.FAILED
    assert lc.reason == f"{cause.summary} (not restarted: the same start would fail the same way)"
    assert (lc.state, lc.pid, lc.last_cause, lc.next_deadline(), lc.restarts) == (
        S.FAILED, None, cause, None, 0)
    assert lc.handle_timer(1e9) == []
    # A manual start gives it a fresh chance, as after flapping.
    assert lc.handle(StartRequested(), 3.0)[-1] == SpawnProcess()


def test_exits_older_than_the_flap_window_are_forgotten() -> None:
    lc = make(flap_max_exits=2, flap_window_s=10.0)
    running(lc, 0.0)
    crash(lc, 5.0)
    lc.handle_timer(6.0)
    lc.handle(BecameReady(), 6.0)
    crash(lc, 15.0)  # the first exit is exactly 10 s old: still inside the window
    assert lc.state is S.FAILED
    lc = make(flap_max_exits=2, flap_window_s=10.0)
    running(lc, 0.0)
    crash(lc, 5.0)
    lc.handle_timer(6.0)
    lc.handle(BecameReady(), 6.0)
    crash(lc, 15.5)
    assert lc.state is S.BACKOFF


@pytest.mark.parametrize(
    "event", [StopRequested(), ProcessExited(CRASH), BecameReady(), AdoptedRunning(1)]
)
def test_failed_ignores_all_but_start(event: Event) -> None:
    lc = make(flap_max_exits=1)
    starting(lc)
    crash(lc, 0.0)
    assert lc.state is S.FAILED
    assert lc.handle(event, 1.0) == []
    assert lc.handle_timer(1000.0) == []
    assert lc.state is S.FAILED


def test_manual_start_from_failed_clears_flap_history() -> None:
    lc = make(flap_max_exits=2)
    starting(lc)
    crash(lc, 0.0)
    lc.handle_timer(1.0)
    crash(lc, 1.0)
    assert lc.reason.startswith("exited 2 times in 60 s")
    actions = lc.handle(StartRequested(), 2.0)
    assert actions == [Transitioned(S.FAILED, S.STARTING, "start requested"), SpawnProcess()]
    assert lc.restarts == 1  # a manual start is not an automatic restart
    crash(lc, 3.0)
    assert lc.state is S.BACKOFF  # one exit since the manual start: no flap
    assert lc.next_deadline() == 4.0  # and the backoff starts over


# -- Start timeout ----------------------------------------------------------------


def test_start_timeout_kills_and_counts_as_a_failure() -> None:
    lc = make()
    starting(lc, 0.0)
    assert lc.handle_timer(29.9) == []
    assert lc.handle_timer(30.0) == [SendSignal("KILL")]
    assert (lc.state, lc.pid, lc.next_deadline()) == (S.STARTING, 100, None)
    assert lc.handle_timer(100.0) == []  # killed once
    assert lc.handle(BecameReady(), 30.1) == []  # too late: it is being killed
    actions = crash(lc, 30.2, OOM)
    reason = "restarting in 1.0 s after: did not become ready within 30 s"
    assert actions == [Transitioned(S.STARTING, S.BACKOFF, reason)]
    assert lc.last_cause == ExitCause("oom", "did not become ready within 30 s", -9)


def test_start_timeout_counts_even_if_the_exit_looks_clean() -> None:
    lc = make(start_timeout_s=2.5)
    starting(lc, 0.0)
    lc.handle_timer(2.5)
    crash(lc, 3.0, CLEAN)
    assert lc.state is S.BACKOFF
    assert lc.reason.endswith("after: did not become ready within 2.5 s")


def test_a_load_that_advances_keeps_its_start_from_timing_out() -> None:
    """A model of any size loads (or downloads) for as long as it advances: each advance
    counts the start timeout again; one that stops advancing is killed that long after
    its last advance, and the reason says so. Once doomed, an advance saves nothing."""
    lc = make(start_timeout_s=10.0)
    starting(lc, 0.0)
    for t in (8.0, 16.0, 24.0):
        assert lc.handle(LoadAdvanced(), t) == [] and lc.next_deadline() == t + 10.0
        assert lc.handle_timer(t + 9.9) == []
    assert lc.handle_timer(34.0) == [SendSignal("KILL")]
    assert lc.handle(LoadAdvanced(), 34.5) == [] and lc.next_deadline() is None
    crash(lc, 35.0, OOM)
    assert lc.reason.endswith("did not become ready within 10 s of its model load's last "
                              "progress")
    lc = make(start_timeout_s=10.0)
    running(lc, 50.0)  # a running worker's load reports are not its concern
    assert lc.handle(LoadAdvanced(), 51.0) == [] and lc.next_deadline() == 80.0


# -- Stopping ---------------------------------------------------------------------


@pytest.mark.parametrize("ready", [False, True])
def test_stop_terminates_then_kills_once(ready: bool) -> None:
    lc = make()
    starting(lc)
    if ready:
        lc.handle(BecameReady(), 1.0)
    old = lc.state
    actions = lc.handle(StopRequested(), 2.0)
    assert actions == [Transitioned(old, S.STOPPING, "stop requested"), SendSignal("TERM")]
    assert (lc.next_deadline(), lc.healthy, lc.pid) == (12.0, False, 100)
    assert lc.handle_timer(11.0) == []
    assert lc.handle_timer(12.0) == [SendSignal("KILL")]
    assert lc.next_deadline() is None
    assert lc.handle_timer(50.0) == []
    actions = crash(lc, 13.0, OOM)  # any exit in STOPPING is the stop we asked for
    assert actions == [Transitioned(S.STOPPING, S.EXITED, "stopped")]
    assert (lc.pid, lc.last_cause, lc.restarts) == (None, OOM, 0)


@pytest.mark.parametrize("when", ["exited", "failed", "stopping"])
def test_stop_when_already_down_or_stopping_does_nothing(when: str) -> None:
    lc = make(flap_max_exits=1)
    if when == "failed":
        starting(lc)
        crash(lc, 0.0)
    if when == "stopping":
        running(lc)
        lc.handle(StopRequested(), 0.0)
    state, deadline = lc.state, lc.next_deadline()
    assert lc.handle(StopRequested(), 1.0) == []
    assert (lc.state, lc.next_deadline()) == (state, deadline)


def test_stop_during_backoff_cancels_the_retry() -> None:
    lc = make()
    starting(lc)
    crash(lc, 0.0)
    actions = lc.handle(StopRequested(), 0.5)
    assert actions == [Transitioned(S.BACKOFF, S.EXITED, "stopped during backoff")]
    assert lc.next_deadline() is None
    assert lc.handle_timer(100.0) == []
    assert (lc.state, lc.restarts) == (S.EXITED, 0)


def test_start_while_stopping_restarts_after_the_exit() -> None:
    lc = make()
    running(lc)
    lc.handle(StopRequested(), 1.0)
    assert lc.handle(StartRequested(), 2.0) == []
    assert lc.state is S.STOPPING
    actions = crash(lc, 3.0, CLEAN)
    assert actions == [Transitioned(S.STOPPING, S.STARTING, "restart requested"), SpawnProcess()]
    assert (lc.pid, lc.restarts, lc.next_deadline()) == (None, 0, 33.0)


def test_stop_after_start_while_stopping_cancels_the_restart() -> None:
    lc = make()
    running(lc)
    lc.handle(StopRequested(), 1.0)
    lc.handle(StartRequested(), 2.0)
    lc.handle(StopRequested(), 2.5)
    assert crash(lc, 3.0) == [Transitioned(S.STOPPING, S.EXITED, "stopped")]


def test_stop_before_spawned_signals_the_pid_once_known() -> None:
    lc = make()
    lc.handle(StartRequested(), 0.0)
    lc.handle(StopRequested(), 0.1)
    assert lc.handle(Spawned(55), 0.2) == [SendSignal("TERM")]
    assert lc.pid == 55


def test_spawn_failed_while_stopping_is_the_end() -> None:
    lc = make()
    lc.handle(StartRequested(), 0.0)
    lc.handle(StopRequested(), 0.1)
    actions = lc.handle(SpawnFailed("exec format error"), 0.2)
    assert actions == [Transitioned(S.STOPPING, S.EXITED, "stopped")]
    assert lc.last_cause == ExitCause("spawn_failed", "exec format error")


# -- Liveness ---------------------------------------------------------------------


def test_failed_probes_mark_unhealthy_and_ok_resets() -> None:
    lc = make(liveness_failures=3)
    running(lc)
    assert lc.handle(HealthProbed(ok=False, reason="timed out"), 1.0) == []
    assert (lc.healthy, lc.reason) == (False, "health probe failed (1/3): timed out")
    lc.handle(HealthProbed(ok=False, reason="timed out"), 2.0)
    assert lc.handle(HealthProbed(ok=True), 3.0) == []
    assert (lc.healthy, lc.reason) == (True, "health probe ok again")
    lc.handle(HealthProbed(ok=False, reason="timed out"), 4.0)
    lc.handle(HealthProbed(ok=False, reason="timed out"), 5.0)
    assert (lc.state, lc.reason) == (S.RUNNING, "health probe failed (2/3): timed out")


def test_ok_probe_keeps_the_reason_when_healthy() -> None:
    lc = make()
    lc.handle(AdoptedRunning(9), 0.0)
    lc.handle(HealthProbed(ok=True), 1.0)
    assert lc.reason == "adopted running process 9"


def test_liveness_restart() -> None:
    lc = make(liveness_failures=2)
    running(lc)
    lc.handle(HealthProbed(ok=False, reason="no answer"), 1.0)
    actions = lc.handle(HealthProbed(ok=False, reason="no answer"), 2.0)
    why = "failed 2 consecutive health probes (last: no answer)"
    assert actions == [
        Transitioned(S.RUNNING, S.STOPPING, f"restarting: {why}"),
        SendSignal("TERM"),
    ]
    assert lc.next_deadline() == 12.0
    assert lc.handle_timer(12.0) == [SendSignal("KILL")]
    actions = crash(lc, 12.5, OOM)
    assert actions == [Transitioned(S.STOPPING, S.BACKOFF, f"restarting in 1.0 s after: {why}")]
    assert lc.last_cause == ExitCause("oom", why, -9)
    lc.handle_timer(13.5)
    assert (lc.state, lc.restarts) == (S.STARTING, 1)


def test_liveness_restarts_count_toward_flapping() -> None:
    lc = make(liveness_failures=1, flap_max_exits=2)
    running(lc)
    crash(lc, 1.0)
    lc.handle_timer(2.0)
    lc.handle(BecameReady(), 2.0)
    lc.handle(HealthProbed(ok=False, reason="wedged"), 3.0)
    crash(lc, 3.5, CLEAN)
    assert lc.state is S.FAILED
    assert lc.reason == (
        "exited 2 times in 60 s; last: failed 1 consecutive health probes (last: wedged)"
    )


def test_stop_during_liveness_restart_stays_down() -> None:
    lc = make(liveness_failures=1)
    running(lc)
    lc.handle(HealthProbed(ok=False, reason="wedged"), 1.0)
    assert lc.handle(StopRequested(), 1.5) == []
    assert crash(lc, 2.0) == [Transitioned(S.STOPPING, S.EXITED, "stopped")]


def test_a_worker_that_said_it_is_stopping_gets_stop_timeout_to_exit_cleanly() -> None:
    # Drained by an outside SIGTERM: it answers "stopping", then its channel closes
    # while the interpreter tears down. Its clean exit reads as finished, not failed.
    lc = make(liveness_failures=2, stop_timeout_s=3.0)
    running(lc)
    assert lc.handle(HealthProbed(ok=True, stopping=True), 1.0) == []
    for t in (2.0, 3.0, 4.5):  # 2.5 s quiet: within stop_timeout_s, not counted
        assert lc.handle(HealthProbed(ok=False, reason="connection refused"), t) == []
    assert lc.state is S.RUNNING and not lc.healthy
    assert "stopping on its own" in lc.reason and "stop_timeout_s" in lc.reason
    assert crash(lc, 4.8, CLEAN) == [
        Transitioned(S.RUNNING, S.EXITED, "finished: exited with status 0")]


def test_a_worker_that_said_it_is_stopping_and_hangs_is_restarted() -> None:
    lc = make(liveness_failures=2, stop_timeout_s=3.0)
    running(lc)
    lc.handle(HealthProbed(ok=True, stopping=True), 1.0)
    lc.handle(HealthProbed(ok=False, reason="timed out"), 2.0)
    lc.handle(HealthProbed(ok=True, stopping=True), 3.0)  # an answer starts the wait again
    assert lc.handle(HealthProbed(ok=False, reason="timed out"), 4.0) == []
    assert lc.handle(HealthProbed(ok=False, reason="timed out"), 6.5) == []
    actions = lc.handle(HealthProbed(ok=False, reason="timed out"), 7.0)
    why = ("it was on its way out, then answered no health probe for 3 s without "
           "exiting (stop_timeout_s 3; last: timed out)")
    assert actions == [Transitioned(S.RUNNING, S.STOPPING, f"restarting: {why}"),
                       SendSignal("TERM")]
    assert crash(lc, 7.5, CLEAN)[0] == Transitioned(
        S.STOPPING, S.BACKOFF, f"restarting in 1.0 s after: {why}")


def test_a_quiet_worker_that_wrote_its_exit_record_gets_stop_timeout() -> None:
    lc = make(liveness_failures=1, stop_timeout_s=3.0)
    running(lc)
    assert lc.handle(HealthProbed(ok=False, reason="refused", stopping=True), 1.0) == []
    assert lc.handle(HealthProbed(ok=False, reason="refused"), 3.5) == []
    assert lc.handle(HealthProbed(ok=False, reason="refused"), 4.0)[1] == SendSignal("TERM")


def test_the_stopping_word_is_forgotten_at_the_next_start() -> None:
    lc = make(liveness_failures=1)
    running(lc)
    lc.handle(HealthProbed(ok=True, stopping=True), 1.0)
    crash(lc, 2.0)
    lc.handle_timer(3.0)
    lc.handle(BecameReady(), 3.0)
    actions = lc.handle(HealthProbed(ok=False, reason="wedged"), 4.0)
    assert actions[0] == Transitioned(
        S.RUNNING, S.STOPPING,
        "restarting: failed 1 consecutive health probes (last: wedged)")


# -- The watchdog: progress reported by a running worker ---------------------------


def test_watchdog_restarts_a_busy_worker_without_steps() -> None:
    lc = make(stall_timeout_s=30.0)
    running(lc)
    assert lc.handle(ProgressReported(busy=True, stalled_s=29.9, steps=7), 1.0) == []
    actions = lc.handle(ProgressReported(busy=True, stalled_s=31.2, steps=7), 2.0)
    why = ("watchdog: it had work but made no progress for 31 s "
           "(stall_timeout_s 30; 7 steps done)")
    assert actions == [Transitioned(S.RUNNING, S.STOPPING, f"restarting: {why}"),
                       SendSignal("TERM")]
    actions = crash(lc, 2.5, CLEAN)  # it stopped as asked: still a failure, of the watchdog
    assert actions == [Transitioned(S.STOPPING, S.BACKOFF, f"restarting in 1.0 s after: {why}")]
    assert lc.last_cause == ExitCause("watchdog", why, 0)
    lc.handle_timer(3.5)
    assert (lc.state, lc.restarts) == (S.STARTING, 1)


@pytest.mark.parametrize("report", [
    ProgressReported(busy=False, stalled_s=0.0, steps=0),  # idle: no work, no steps
    ProgressReported(busy=False, stalled_s=99.0, steps=3),  # not busy: never a stall
])
def test_watchdog_leaves_an_idle_worker_be(report: ProgressReported) -> None:
    lc = make(stall_timeout_s=5.0)
    running(lc)
    assert lc.handle(report, 1.0) == []
    assert lc.state is S.RUNNING


def test_watchdog_off_at_zero() -> None:
    lc = make(stall_timeout_s=0.0)
    running(lc)
    assert lc.handle(ProgressReported(busy=True, stalled_s=1e6, steps=1), 1.0) == []
    assert lc.state is S.RUNNING


def test_watchdog_report_outside_running_is_ignored() -> None:
    lc = make(stall_timeout_s=1.0)
    starting(lc)
    assert lc.handle(ProgressReported(busy=True, stalled_s=9.0, steps=0), 1.0) == []
    assert lc.state is S.STARTING


# -- Deadlines --------------------------------------------------------------------


def test_next_deadline_per_state() -> None:
    lc = make(start_timeout_s=5.0, stable_after_s=7.0, stop_timeout_s=3.0, **NO_FLAP)
    assert lc.next_deadline() is None  # EXITED
    lc.handle(StartRequested(), 100.0)
    assert lc.next_deadline() == 105.0  # start timeout
    lc.handle(BecameReady(), 101.0)
    assert lc.next_deadline() == 108.0  # stable period
    crash(lc, 102.0)
    assert lc.next_deadline() == 103.0  # retry
    lc.handle_timer(103.0)
    assert lc.next_deadline() == 108.0  # start timeout again
    lc.handle(StopRequested(), 104.0)
    assert lc.next_deadline() == 107.0  # kill
    crash(lc, 104.5)
    assert lc.next_deadline() is None  # EXITED


def test_handle_timer_with_nothing_armed_is_a_no_op() -> None:
    lc = make()
    assert lc.handle_timer(1e9) == []
    assert lc.state is S.EXITED


# -- Properties -------------------------------------------------------------------

TIMER = "timer"
events = st.one_of(
    st.just(StartRequested()),
    st.just(StopRequested()),
    st.builds(AdoptedRunning, st.integers(1, 99)),
    st.builds(Spawned, st.integers(1, 99)),
    st.builds(SpawnFailed, st.just("exec failed")),
    st.just(BecameReady()),
    st.builds(HealthProbed, st.booleans(), st.just("slow")),
    st.builds(ProgressReported, st.booleans(), st.floats(0.0, 60.0), st.integers(0, 9)),
    st.builds(ProcessExited, st.sampled_from([CLEAN, CRASH, OOM])),
    st.just(TIMER),
)
steps = st.lists(st.tuples(st.floats(0.0, 100.0), events), max_size=60)


@settings(max_examples=300, deadline=None)
@given(
    steps=steps,
    random=st.floats(0.0, 1.0, exclude_max=True),
    flap=st.integers(1, 6),
    probes=st.integers(1, 3),
)
def test_invariants_hold_for_any_event_sequence(
    steps: list[tuple[float, Event | str]], random: float, flap: int, probes: int
) -> None:
    lc = make(random, flap_max_exits=flap, liveness_failures=probes, flap_window_s=200.0)
    now = 0.0
    for dt, event in steps:
        now += dt
        before = lc.state
        if isinstance(event, str):
            deadline = lc.next_deadline()
            now = max(now, deadline) if deadline is not None and dt > 50 else now
            actions = lc.handle_timer(now)
            deadline = lc.next_deadline()
            assert deadline is None or deadline > now  # everything due has fired
        else:
            actions = lc.handle(event, now)
        assert isinstance(lc.state, WorkerState)
        assert all(isinstance(a, SpawnProcess | SendSignal | Transitioned) for a in actions)
        transitions = [a for a in actions if isinstance(a, Transitioned)]
        if lc.state is before:
            assert transitions == []
        else:
            assert transitions == [actions[0]]
            assert actions[0] == Transitioned(before, lc.state, lc.reason)
        if before is S.FAILED and not isinstance(event, StartRequested):
            assert lc.state is S.FAILED
        if any(isinstance(a, SpawnProcess) for a in actions):
            assert lc.pid is None and lc.state is S.STARTING
        if lc.state in (S.EXITED, S.FAILED):
            assert lc.next_deadline() is None
        if lc.state in (S.EXITED, S.FAILED, S.BACKOFF):
            assert lc.pid is None
        if lc.state is S.BACKOFF:
            assert lc.next_deadline() is not None
        assert lc.healthy is False or lc.state is S.RUNNING
