"""A tensor-parallel group in `mlxctl status` and `mlxctl workers` (``render.worker_groups``)
and in the problems (``supervisor/health.py``): pure, from workers as the supervisor's
snapshot gives them."""

from __future__ import annotations

from typing import Any

from mlxceld.supervisor.health import problems
from mlxctl import render


def member(name: str, role: str, state: str = "running", pid: int | None = 100,
           reason: str = "", rank: int | None = None) -> dict[str, Any]:
    return {"name": name, "role": role, "group": "tp", "state": state, "pid": pid,
            "healthy": True if state == "running" else None, "reason": reason,
            "restarts": 0, "last_exit": "", "started_at": None, "rss_bytes": 150 << 20,
            "stats": None if rank is None else {"tensor": {"rank": rank, "size": 3}}}


def test_a_running_group_names_its_ranks_and_each_ranks_pid_state_and_rss() -> None:
    lines = "\n".join(render.worker_groups([
        member("tp-2", "tp", pid=102), member("router", "router", pid=100, rank=0),
        member("tp-1", "tp", pid=101, rank=1),
        {**member("echo", "echo"), "group": None}])).split("\n")
    assert lines[1] == ("tensor group tp: 3 ranks (router = rank 0, tp-1, tp-2), "
                        "all running")
    assert lines[2].split() == ["RANK", "WORKER", "STATE", "PID", "RSS"]
    assert [line.split()[:4] for line in lines[3:]] == [
        ["0", "router", "running", "100"], ["1", "tp-1", "running", "101"],
        ["2", "tp-2", "running", "102"]]
    assert all("150.0 MiB" in line for line in lines[3:])
    assert render.worker_groups([{**member("echo", "echo"), "group": None}]) == []


def test_a_member_down_is_said_in_the_group_line_and_is_a_problem_naming_its_rank() -> None:
    workers = [member("router", "router", state="starting"),
               member("tp-1", "tp", state="backoff", pid=None,
                      reason="restarting in 0.2 s after: killed by SIGKILL")]
    line = render.worker_groups(workers)[1]
    assert line.startswith("tensor group tp: 2 ranks (router = rank 0, tp-1), 0 of 2 running "
                           "(router starting, tp-1 backoff)")
    [found] = problems(workers)  # a starting rank is no problem; one in backoff is
    assert found == {
        "subject": "tp-1",
        "message": "worker tp-1 (rank 1 of tensor group tp) is restarting: restarting in "
                   "0.2 s after: killed by SIGKILL; the group serves once every rank runs "
                   "again (its members restart together)",
        "next": "mlxctl logs tp-1"}


def test_a_failed_or_stopped_member_says_a_restart_of_it_restarts_the_group() -> None:
    failed, stopped = problems([
        member("tp-1", "tp", state="failed", pid=None, reason="exited 5 times in 60 s"),
        member("router", "router", state="exited", pid=None,
               reason="stopped: group tp: tp-1 failed")])
    assert failed["message"] == ("worker tp-1 (rank 1 of tensor group tp) failed: exited 5 "
                                 "times in 60 s; the group is stopped with it")
    assert failed["next"] == "mlxctl logs tp-1; then: mlxctl restart tp-1 (restarts the " \
        "whole group)"
    assert stopped["message"].startswith("worker router (rank 0 of tensor group tp) is not "
                                         "running (stopped: group tp: tp-1 failed)")
    assert stopped["next"] == "mlxctl restart router (restarts the whole group)"
