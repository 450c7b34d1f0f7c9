"""A real daemon supervising real worker processes: restarts, flapping, re-adoption, signals."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator

import pytest

from mlxceld.daemon import SHUTDOWN_SLACK_S

from helpers.daemons import FAST_POLICY, TWO_ECHOS, DaemonProc, Daemons, alive
from helpers.waiting import wait_for


@pytest.fixture(scope="module")
def two_echos() -> Iterator[DaemonProc]:
    """One daemon with workers alpha and beta for the tests below that leave both running,
    never restarted (a reload of the same config; a broken config file, put back)."""
    owner = Daemons()
    try:
        yield owner.make(TWO_ECHOS).start()
    finally:
        owner.end()


def test_status_shows_daemon_and_workers(two_echos: DaemonProc) -> None:
    d = two_echos
    d.wait_worker("alpha", state="running")
    d.wait_worker("beta", state="running")
    body = json.loads(d.ctl("status", "--json").stdout)
    assert body["schema"] == "mlxctl.status/1"
    assert body["daemon"]["pid"] == d.pid
    assert body["problems"] == []
    out = d.ctl("status")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("mlxceld ") and f"pid {d.pid}" in lines[0]
    assert any(line.startswith("alpha") and "running" in line for line in lines)
    assert lines[-1] == "health: ok"
    assert "\x1b[" not in out.stdout  # no colour off a TTY


def test_kill9_worker_is_restarted_with_backoff_and_recorded(daemons: Daemons) -> None:
    d = daemons.make(TWO_ECHOS).start()
    first = d.wait_worker("alpha", state="running")["pid"]
    daemons.pids.add(first)
    os.kill(first, signal.SIGKILL)
    again = wait_for(lambda: (w := d.worker("alpha"))["state"] == "running"
                     and w["pid"] not in (first, None) and w, 20, "alpha restarted")
    daemons.pids.add(again["pid"])
    assert again["restarts"] == 1
    # A kill -9 by hand is no OOM kill: the cgroup's counter says so, or nothing does.
    assert again["last_exit"] == "killed by SIGKILL"
    backoff = [e for e in d.events() if e["kind"] == "worker.backoff" and e["subject"] == "alpha"]
    assert backoff and "SIGKILL" in backoff[-1]["message"]
    assert backoff[-1]["data"]["cause"] == "signal"
    assert d.worker("beta")["restarts"] == 0


def test_flapping_worker_goes_to_failed_with_the_reason(daemons: Daemons) -> None:
    d = daemons.make(FAST_POLICY + """
[workers.flappy]
role = "echo"
options = { crash_after_s = 0.1 }
flap_max_exits = 3
flap_window_s = 60.0
""").start()
    w = d.wait_worker("flappy", timeout=30, state="failed")
    assert "exited 3 times" in w["reason"]
    assert "RuntimeError: echo worker flappy crashed on purpose" in w["reason"]
    assert w["pid"] is None
    problems = d.status()["problems"]
    assert problems[0]["subject"] == "flappy"
    assert problems[0]["next"].startswith("mlxctl logs flappy")
    text = d.ctl("status").stdout
    assert "health: 1 problem(s)" in text and "next: mlxctl logs flappy" in text
    time.sleep(1.0)  # failed means no more restarts
    assert d.worker("flappy")["state"] == "failed"
    assert d.ctl("restart", "flappy").returncode == 0
    wait_for(lambda: d.worker("flappy")["state"] in ("starting", "running", "backoff"), 10,
             "flappy restarted by hand")


def test_exit_causes_are_classified(daemons: Daemons) -> None:
    d = daemons.make(FAST_POLICY + """
[workers.status3]
role = "echo"
options = { exit_after_s = 0.2, exit_code = 3 }
flap_max_exits = 1

[workers.done]
role = "echo"
options = { exit_after_s = 0.2 }
""").start()
    assert d.wait_worker("status3", state="failed")["last_exit"] == "exited with status 3"
    done = d.wait_worker("done", state="exited")
    assert done["last_exit"] == "exited cleanly" and done["restarts"] == 0


def test_daemon_kill9_then_restart_readopts_the_same_worker(daemons: Daemons) -> None:
    d = daemons.make(TWO_ECHOS).start()
    pid = d.wait_worker("alpha", state="running")["pid"]
    daemons.note(d)
    os.kill(d.pid, signal.SIGKILL)
    assert d.proc is not None
    d.proc.wait()
    assert alive(pid), "a worker must survive its daemon"
    d.start()
    w = d.wait_worker("alpha", state="running")
    assert w["pid"] == pid and w["restarts"] == 0
    adopted = [e for e in d.events() if e["kind"] == "worker.adopted"]
    assert {e["subject"] for e in adopted} == {"alpha", "beta"}
    # The adopted worker is still supervised: killing it now gets it restarted.
    os.kill(pid, signal.SIGKILL)
    w = wait_for(lambda: (x := d.worker("alpha"))["state"] == "running" and x["pid"] != pid
                 and x, 20, "adopted worker restarted")
    daemons.pids.add(w["pid"])


def test_a_daemon_restart_keeps_a_workers_restart_count_and_uptime(daemons: Daemons) -> None:
    d = daemons.make(TWO_ECHOS).start()
    first = d.wait_worker("alpha", state="running")["pid"]
    daemons.pids.add(first)
    os.kill(first, signal.SIGKILL)
    w = wait_for(lambda: (x := d.worker("alpha"))["state"] == "running"
                 and x["pid"] not in (first, None) and x, 20, "alpha restarted")
    daemons.note(d)
    assert w["restarts"] == 1

    # Re-adopted by the next daemon (this one killed): the same process, count and start.
    os.kill(d.pid, signal.SIGKILL)
    assert d.proc is not None
    d.proc.wait()
    d.start()
    adopted = d.wait_worker("alpha", state="running")
    assert (adopted["pid"], adopted["restarts"]) == (w["pid"], 1)
    assert adopted["started_at"] == w["started_at"]
    shown = json.loads(d.ctl("workers", "--json").stdout)
    [alpha] = [x for x in shown["workers"] if x["name"] == "alpha"]
    assert alpha["started_at"] == w["started_at"]

    # Stopped with the daemon and started by the next one: a new process, the same count.
    assert d.terminate() == 0
    d.start()
    again = d.wait_worker("alpha", state="running")
    daemons.note(d)
    assert again["pid"] != w["pid"] and again["restarts"] == 1
    assert again["started_at"] > w["started_at"]


def test_sighup_reloads_without_restarting_workers(two_echos: DaemonProc) -> None:
    d = two_echos
    before = {w["name"]: w["pid"] for w in (d.wait_worker(n, state="running")
                                          for n in ("alpha", "beta"))}
    os.kill(d.pid, signal.SIGHUP)
    wait_for(lambda: any(e["kind"] == "daemon.reloaded" for e in d.events()), 10, "reload")
    after = {w["name"]: w["pid"] for w in d.status()["workers"]}
    assert after == before
    assert all(w["restarts"] == 0 for w in d.status()["workers"])


def test_sighup_with_a_broken_config_keeps_running(two_echos: DaemonProc) -> None:
    d = two_echos
    d.wait_worker("alpha", state="running")
    good = d.config.read_text()
    d.config.write_text("[daemon\n")
    try:
        os.kill(d.pid, signal.SIGHUP)
        failed = wait_for(lambda: [e for e in d.events()
                                   if e["kind"] == "daemon.reload_failed"],
                          10, "reload failure event")
    finally:  # the shared daemon's file as it was (the daemon kept its config anyway)
        d.config.write_text(good)
    assert "not valid TOML" in failed[0]["message"]
    assert d.worker("alpha")["state"] == "running"


def test_sigterm_ends_every_process(daemons: Daemons) -> None:
    d = daemons.make(TWO_ECHOS).start()
    pids = [d.wait_worker(n, state="running")["pid"] for n in ("alpha", "beta")]
    daemons.note(d)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0
    for pid in [d.pid, *pids]:
        assert not alive(pid), f"pid {pid} outlived the daemon"
    assert not d.socket.exists()


def test_stuck_worker_is_killed_after_its_stop_timeout(daemons: Daemons) -> None:
    d = daemons.make(FAST_POLICY + """
[workers.stuck]
role = "echo"
options = { ignore_term = true }
stop_timeout_s = 0.5
""").start()
    pid = d.wait_worker("stuck", state="running")["pid"]
    daemons.pids.add(pid)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0
    assert not alive(pid)


def daemon_events(d: DaemonProc) -> list[str]:
    """The daemon's own event kinds in its database, read once it has exited."""
    db = sqlite3.connect(d.state_dir / "state.db")
    try:
        return [kind for (kind,) in db.execute(
            "SELECT kind FROM events WHERE subject = 'daemon' ORDER BY id")]
    finally:
        db.close()


def test_a_clean_shutdown_is_recorded(daemons: Daemons) -> None:
    d = daemons.make(TWO_ECHOS).start()
    d.wait_worker("alpha", state="running")
    assert d.terminate(timeout=20) == 0
    assert daemon_events(d)[-3:] == ["daemon.started", "daemon.stopping", "daemon.stopped"]


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT),
                                           (signal.SIGINT, signal.SIGTERM)],
                         ids=["TERM-then-INT", "INT-then-TERM"])
def test_a_second_signal_forces_exit_1(daemons: Daemons, first: signal.Signals,
                                       second: signal.Signals) -> None:
    # The stuck worker's 60 s stop timeout keeps the drain going far past the wait below:
    # only the second signal can end the daemon in time.
    d = daemons.make(FAST_POLICY + """
[workers.stuck]
role = "echo"
options = { ignore_term = true }
stop_timeout_s = 60
""").start()
    pid = d.wait_worker("stuck", state="running")["pid"]
    daemons.pids.add(pid)
    assert d.proc is not None
    d.proc.send_signal(first)
    wait_for(lambda: d.status()["daemon"]["state"] == "stopping", 10, "the daemon stopping")
    d.proc.send_signal(second)
    assert d.proc.wait(timeout=20) == 1
    wait_for(lambda: not alive(pid), 5, "the stuck worker killed")
    assert not d.socket.exists()
    assert daemon_events(d)[-2:] == ["daemon.started", "daemon.stopping"]


def test_a_worker_that_outlives_its_kill_is_killed_at_the_shutdown_deadline(
        daemons: Daemons) -> None:
    # The fail point drops the worker's own SIGKILL at its stop timeout (a process that
    # cannot die): the daemon's backstop, the longest stop timeout plus SHUTDOWN_SLACK_S,
    # must SIGKILL every group and end the daemon, exit 1.
    stop_timeout_s = 0.5
    d = daemons.make(FAST_POLICY + f"""
[workers.stuck]
role = "echo"
options = {{ ignore_term = true }}
stop_timeout_s = {stop_timeout_s}
""").start(env={"MLXCELD_FAILPOINT": "worker-kill-lost"})
    pid = d.wait_worker("stuck", state="running")["pid"]
    daemons.pids.add(pid)
    assert d.proc is not None
    sent = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=60) == 1, d.stderr()
    took = time.monotonic() - sent
    deadline_s = stop_timeout_s + SHUTDOWN_SLACK_S
    # Not before the deadline (the clock starts after the signal is sent), and at it: the
    # few seconds of margin are the closing and a loaded machine, not the deadline.
    assert deadline_s <= took < deadline_s + 10, took
    wait_for(lambda: not alive(pid), 5, "the stuck worker killed")
    assert not d.socket.exists()
    assert daemon_events(d)[-3:] == ["daemon.started", "daemon.stopping", "daemon.forced_stop"]
    assert "fail point worker-kill-lost" in d.stderr()


def test_mlxctl_stop_stops_the_daemon(daemons: Daemons) -> None:
    d = daemons.make(TWO_ECHOS).start()
    pid = d.wait_worker("alpha", state="running")["pid"]
    daemons.note(d)
    out = d.ctl("stop")
    assert out.returncode == 0, out.stderr
    assert f"mlxceld (pid {d.pid}) stopped" in out.stdout
    assert d.proc is not None and d.proc.wait(timeout=10) == 0
    assert not alive(pid)


def test_hung_worker_is_restarted_after_failed_health_probes(daemons: Daemons) -> None:
    d = daemons.make(FAST_POLICY + """
[workers.frozen]
role = "echo"
options = { freeze_after_s = 0.5 }
liveness_failures = 2
stop_timeout_s = 0.5
""").start()
    first = d.wait_worker("frozen", state="running")["pid"]
    daemons.pids.add(first)
    w = wait_for(lambda: (x := d.worker("frozen"))["restarts"] >= 1 and x, 30,
                 "the hung worker restarted")
    if w["pid"]:
        daemons.pids.add(w["pid"])
    assert not alive(first)
    kinds = [e["kind"] for e in d.events() if e["subject"] == "frozen"]
    assert "worker.stopping" in kinds and "worker.backoff" in kinds
    stopping = next(e for e in d.events() if e["kind"] == "worker.stopping")
    assert "health probes" in stopping["message"]


def test_sighup_applies_added_and_removed_workers(daemons: Daemons) -> None:
    d = daemons.make(TWO_ECHOS).start()
    alpha = d.wait_worker("alpha", state="running")["pid"]
    beta = d.wait_worker("beta", state="running")["pid"]
    daemons.note(d)
    d.config.write_text(FAST_POLICY + """
[workers.alpha]
role = "echo"
options = { interval_s = 0.5 }

[workers.gamma]
role = "echo"
""")
    os.kill(d.pid, signal.SIGHUP)
    gamma = d.wait_worker("gamma", state="running")
    daemons.pids.add(gamma["pid"])
    wait_for(lambda: not alive(beta), 10, "removed worker beta stopped")
    names = [w["name"] for w in d.status()["workers"]]
    assert names == ["alpha", "gamma"]
    assert d.worker("alpha")["pid"] == alpha  # changed spec: no restart
    assert any(e["kind"] == "worker.config_changed" for e in d.events())
