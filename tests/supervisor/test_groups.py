"""Worker groups (supervisor/groups.py): a member's failure restarts the others at once
(SIGTERM, SIGKILL after ``GROUP_STOP_S``),
``restart`` of one restarts all, a member that stops for good on its own stops the rest;
a worker outside the group is left alone. Real ``echo`` worker processes under a real
supervisor; the rule itself also by hand, for the cases a process cannot show quickly
(health probes, the watchdog)."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path

from mlxceld.roles.options import EchoOptions
from mlxceld.state import EventLog
from mlxceld.supervisor.groups import GroupAction, group_rule
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.supervisor.states import RestartPolicy
from mlxceld.types import WorkerState

from helpers.supervisor import running_supervisor
from helpers.waiting import until

S = WorkerState
QUICK = RestartPolicy(backoff_initial_s=0.2, backoff_jitter=0.0, stop_timeout_s=5.0)
DEADLINE_S = 30.0  # worker imports on a loaded machine; nothing here is about time


def spec(state_dir: Path, name: str, group: str | None = "g",
         options: EchoOptions | None = None) -> WorkerSpec:
    return WorkerSpec(name, state_dir, options or EchoOptions(interval_s=0.1), QUICK,
                      group=group)


def pids(supervisor: Supervisor) -> dict[str, int | None]:
    return {w.name: w.pid if w.state == "running" else None for w in supervisor.snapshot()}


async def all_running(supervisor: Supervisor, what: str) -> dict[str, int | None]:
    return await until(lambda: (p := pids(supervisor)) and all(p.values()) and p, what,
                       timeout=DEADLINE_S, every=0.05)


def group_events(events: EventLog) -> list[tuple[str, str, str]]:
    return [(e.kind, e.subject, e.message) for e in events.since(0, 500)
            if e.kind.startswith("worker.group_")]


def test_a_killed_member_restarts_its_group_and_no_one_else(state_dir: Path) -> None:
    async def main() -> None:
        async with running_supervisor(state_dir) as (supervisor, events):
            await supervisor.reconcile([spec(state_dir, "a"), spec(state_dir, "b"),
                                        spec(state_dir, "solo", group=None)])
            before = await all_running(supervisor, "a, b and solo running")
            assert {w.name: w.group for w in supervisor.snapshot()} == {
                "a": "g", "b": "g", "solo": None}
            assert before["a"] is not None
            os.kill(before["a"], signal.SIGKILL)
            after = await until(
                lambda: (p := pids(supervisor)) and all(p.values())
                and p["a"] != before["a"] and p["b"] != before["b"] and p,
                "a and b both running as new processes", timeout=DEADLINE_S)
            assert after["solo"] == before["solo"]  # outside the group: untouched
            [(kind, subject, message)] = group_events(events)
            assert (kind, subject) == ("worker.group_restart", "a")
            assert message == ("group g: a exited (killed by SIGKILL); its group "
                               "restarts together")
            # The restarted member says why in its events.
            b_starts = [e.message for e in events.since(0, 500) if e.subject == "b"
                        and e.kind == "worker.starting"]
            assert b_starts[-1].endswith(message)
    asyncio.run(main())


def test_restart_of_a_member_restarts_the_group(state_dir: Path) -> None:
    async def main() -> None:
        async with running_supervisor(state_dir) as (supervisor, events):
            await supervisor.reconcile([spec(state_dir, "a"), spec(state_dir, "b")])
            before = await all_running(supervisor, "a and b running")
            supervisor.restart("b")
            await until(lambda: (p := pids(supervisor)) and all(p.values())
                        and p["a"] != before["a"] and p["b"] != before["b"],
                        "a and b both restarted", timeout=DEADLINE_S)
            assert group_events(events) == []  # asked for: not a failure
            asked = [e.message for e in events.since(0, 500)
                     if e.kind == "worker.restart_requested"]
            assert sorted(asked) == ["restart of b requested"] * 2
            await supervisor.reconcile([])  # all stopped as asked (unserve, shutdown)
            assert group_events(events) == []
    asyncio.run(main())


def test_a_member_that_exits_cleanly_stops_its_group(state_dir: Path) -> None:
    async def main() -> None:
        async with running_supervisor(state_dir) as (supervisor, events):
            ending = EchoOptions(interval_s=0.1, exit_after_s=0.5, exit_code=0)
            await supervisor.reconcile([spec(state_dir, "a", options=ending),
                                        spec(state_dir, "b")])
            await until(lambda: group_events(events) and all(
                (supervisor.state(n) or (None,))[0] is S.EXITED for n in ("a", "b")),
                        "a and b both exited", timeout=DEADLINE_S)
            _, reason = supervisor.state("b") or (None, "")
            assert reason == ("stopped: group g: a exited (exited cleanly); its group is "
                              "stopped with it: mlxctl restart a starts them all")
            assert [k for k, _, _ in group_events(events)] == ["worker.group_stop"]
    asyncio.run(main())


def test_the_rule_by_hand() -> None:
    def rule(old: S, new: S, reason: str = "", summary: str | None = None,
             failing: str = "") -> GroupAction | None:
        return group_rule("tp", "tp-1", old, new, reason, exit_summary=summary,
                          failing=failing)

    assert rule(S.RUNNING, S.STOPPING, "restarting: failed 6 consecutive health probes",
                failing="failed 6 consecutive health probes (last: timeout)") == GroupAction(
        "restart", "group tp: tp-1 is stopped: failed 6 consecutive health probes (last: "
        "timeout); its group restarts together")
    watchdog = rule(S.RUNNING, S.STOPPING, failing="watchdog: it had work but made no "
                    "progress for 31 s")
    assert watchdog is not None and watchdog.kind == "restart" and "watchdog" in watchdog.reason
    timed_out = rule(S.STARTING, S.BACKOFF, summary="did not become ready within 30 s")
    assert timed_out == GroupAction("restart", "group tp: tp-1 exited (did not become ready "
                                    "within 30 s); its group restarts together")
    failed = rule(S.RUNNING, S.FAILED, "exited 5 times in 60 s; last: exited with status 1")
    assert failed is not None and failed.kind == "stop"
    assert "exited 5 times in 60 s" in failed.reason and "mlxctl restart tp-1" in failed.reason
    # A stop we asked for, and what happens after it, ask nothing of the others.
    assert rule(S.RUNNING, S.STOPPING, "stop requested") is None
    assert rule(S.STOPPING, S.EXITED, "stopped") is None
    assert rule(S.STOPPING, S.BACKOFF, summary="failed 6 consecutive health probes") is None
    assert rule(S.STOPPING, S.STARTING, "restart requested") is None
    assert rule(S.BACKOFF, S.STARTING) is None and rule(S.STARTING, S.RUNNING) is None


def test_a_groups_stops_kill_at_once_and_carry_their_reason() -> None:
    import random

    from mlxceld.supervisor.events import (
        BecameReady,
        KillRequested,
        ProcessExited,
        SendSignal,
        Spawned,
        StartRequested,
        StopRequested,
        Transitioned,
    )
    from mlxceld.supervisor.events import ExitCause as Cause
    from mlxceld.supervisor.states import Lifecycle

    m = Lifecycle("router", QUICK, random.random)
    m.handle(StartRequested(), 0.0)
    m.handle(Spawned(7), 0.1)
    m.handle(BecameReady(), 0.2)
    why = "group tp: tp-1 exited (killed by SIGKILL); its group restarts together"
    assert m.handle(StopRequested(why, at_once=True), 1.0) == [
        Transitioned(S.RUNNING, S.STOPPING, why), SendSignal("KILL")]
    assert m.handle(StartRequested(why), 1.1) == []  # after the exit
    [moved, _] = m.handle(ProcessExited(Cause("signal", "killed by SIGKILL")), 1.2)
    assert moved == Transitioned(S.STOPPING, S.STARTING, why)
    # A stop as asked by hand: SIGTERM, and KillRequested kills it now.
    m.handle(Spawned(8), 1.3)
    m.handle(BecameReady(), 1.4)
    assert m.handle(StopRequested(), 2.0)[-1] == SendSignal("TERM")
    assert m.handle(KillRequested(), 2.1) == [SendSignal("KILL")]
    [stopped] = m.handle(ProcessExited(Cause("signal", "killed by SIGKILL")), 2.2)
    assert stopped == Transitioned(S.STOPPING, S.EXITED, "stopped")


def test_a_groups_rule_stops_its_members_with_sigterm_and_kills_them_shortly() -> None:
    """The rule's stops (``GROUP_STOP_S``): SIGTERM, so that a router answers its requests
    with the group's error, and SIGKILL once that short bound passes, not the worker's
    stop timeout."""
    import random

    from mlxceld.supervisor.events import (
        BecameReady,
        SendSignal,
        Spawned,
        StartRequested,
        StopRequested,
        Transitioned,
    )
    from mlxceld.supervisor.groups import GROUP_STOP_S
    from mlxceld.supervisor.states import Lifecycle

    assert QUICK.stop_timeout_s > GROUP_STOP_S
    m = Lifecycle("router", QUICK, random.random)
    m.handle(StartRequested(), 0.0)
    m.handle(Spawned(7), 0.1)
    m.handle(BecameReady(), 0.2)
    why = "group tp: tp-1 exited (killed by SIGKILL); its group restarts together"
    assert m.handle(StopRequested(why, within_s=GROUP_STOP_S), 1.0) == [
        Transitioned(S.RUNNING, S.STOPPING, why), SendSignal("TERM")]
    assert m.next_deadline() == 1.0 + GROUP_STOP_S
    assert m.handle_timer(1.0 + GROUP_STOP_S) == [SendSignal("KILL")]


def test_a_group_whose_members_change_restarts_the_members_it_keeps(state_dir: Path) -> None:
    async def main() -> None:
        async with running_supervisor(state_dir) as (supervisor, events):
            await supervisor.reconcile([spec(state_dir, "a"), spec(state_dir, "b")])
            before = await all_running(supervisor, "a and b running")
            await supervisor.reconcile([spec(state_dir, "a"), spec(state_dir, "b"),
                                        spec(state_dir, "c")])  # a reload: tp_size 3
            await until(lambda: (p := pids(supervisor)) and all(p.values())
                        and p["a"] != before["a"] and p["b"] != before["b"],
                        "a and b restarted, c started", timeout=DEADLINE_S)
            assert group_events(events) == [(
                "worker.group_restart", "g", "group g: its members changed (now a, b, "
                "c); its group restarts together")]
            again = pids(supervisor)
            await supervisor.reconcile([spec(state_dir, "a"), spec(state_dir, "b"),
                                        spec(state_dir, "c")])  # the same: nothing
            assert pids(supervisor) == again and len(group_events(events)) == 1
            # A worker joining a group (tp_size 1 -> 2: the router) restarts too.
            await supervisor.reconcile([spec(state_dir, "a", group=None),
                                        spec(state_dir, "b", group=None)])
            joined = await all_running(supervisor, "a and b on their own")
            await supervisor.reconcile([spec(state_dir, "a"), spec(state_dir, "d")])
            await until(lambda: (p := pids(supervisor)) and all(p.values())
                        and p["a"] != joined["a"], "a restarted into the group",
                        timeout=DEADLINE_S)
    asyncio.run(main())


def test_a_worker_removed_with_a_short_stop_is_killed_then_and_says_why(
        state_dir: Path) -> None:
    """``remove(name, reason, within_s=...)``, as a tensor stage whose ring moved is
    stopped (``daemon/stage_peers.py``): a worker that takes no SIGTERM (here stopped
    with SIGSTOP; there waiting in mlx's ring join) is killed ``within_s`` after it,
    not at its stop timeout (60 s here), and the events say why."""
    async def main() -> None:
        async with running_supervisor(state_dir) as (supervisor, events):
            slow = replace(spec(state_dir, "a", group=None),
                           policy=replace(QUICK, stop_timeout_s=60.0))
            await supervisor.reconcile([slow])
            pid = (await all_running(supervisor, "a running"))["a"]
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            async with asyncio.timeout(30):  # well under its stop timeout
                await supervisor.remove("a", "its ring moved", within_s=0.5)
            assert supervisor.names() == []
            said = [(e.kind, e.message) for e in events.since(0, 500) if e.subject == "a"]
            assert ("worker.stopping", "worker a: running -> stopping: its ring moved") \
                in said, said
            assert said[-1] == ("worker.removed", "worker a removed (its ring moved)"), said
    asyncio.run(main())
