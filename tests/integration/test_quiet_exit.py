"""A worker on its way out is let exit: real echo workers, SIGTERMed from outside (as
a user's ``kill`` or an OS shutdown would), whose exit is slow after their control
channel closed (the interpreter's teardown: ``teardown_s``), some after draining
(``drain_s``: they answer "stopping" meanwhile). Their failed health probes are not
counted (supervisor/states.py): a clean exit reads as finished, not as a worker
restarted for failed probes. One that never exits is killed ``stop_timeout_s`` after
it went quiet, and restarted, naming why.
"""

from __future__ import annotations

import os
import signal

from helpers.daemons import FAST_POLICY, Daemons, alive
from helpers.waiting import wait_for

STOP_S = 6.0  # stop_timeout_s: the grace of a quiet worker on its way out
TEARDOWN_S = 2.5  # > liveness_failures x health_interval_s (2 x 0.5 s), < STOP_S
assert "stop_timeout_s = 3.0" in FAST_POLICY
CONFIG = FAST_POLICY.replace("stop_timeout_s = 3.0", f"stop_timeout_s = {STOP_S}") + f"""
liveness_failures = 2

[workers.slow]
role = "echo"
options = {{ interval_s = 0.1, teardown_s = {TEARDOWN_S} }}

[workers.draining]
role = "echo"
options = {{ interval_s = 0.1, drain_s = 1.5, teardown_s = {TEARDOWN_S} }}

[workers.hung]
role = "echo"
options = {{ interval_s = 0.1, teardown_s = 600 }}
"""


def test_a_slow_exit_after_sigterm_is_finished_and_a_hung_one_is_killed(
        daemons: Daemons) -> None:
    d = daemons.make(CONFIG).start()
    pids = {name: d.wait_worker(name, state="running")["pid"]
            for name in ("slow", "draining", "hung")}
    daemons.pids |= set(pids.values())
    for pid in pids.values():
        os.kill(pid, signal.SIGTERM)

    for name in ("slow", "draining"):
        w = d.wait_worker(name, timeout=30, state="exited")
        assert not alive(pids[name])
        seen = [e for e in d.events(400) if e["subject"] == name]
        assert [e["kind"] for e in seen if e["kind"] in (
            "worker.exited", "worker.stopping", "worker.backoff")] == ["worker.exited"], \
            [e["message"] for e in seen]
        exited = next(e for e in seen if e["kind"] == "worker.exited")
        assert exited["data"]["cause"] == "clean", exited
        assert exited["data"]["reason"].startswith("finished"), exited
        assert w["restarts"] == 0, w

    stopping = wait_for(lambda: [e for e in d.events(400) if e["subject"] == "hung"
                                 and e["kind"] == "worker.stopping"], 60, "hung stopped")[0]
    reason = stopping["data"]["reason"]
    assert reason.startswith("restarting: it was on its way out, then answered no health "
                             "probe for "), reason
    assert f"without exiting (stop_timeout_s {STOP_S:g};" in reason, reason
    again = wait_for(lambda: (w := d.worker("hung"))["state"] == "running"
                     and w["pid"] not in (pids["hung"], None) and w, 60, "hung restarted")
    daemons.pids.add(again["pid"])
    assert not alive(pids["hung"])
    backoff = [e for e in d.events(400) if e["subject"] == "hung"
               and e["kind"] == "worker.backoff"]
    assert backoff and "on its way out" in backoff[-1]["message"], backoff
    # The finished ones stay down: a clean exit of a worker is not restarted.
    for name in ("slow", "draining"):
        assert d.worker(name)["state"] == "exited"
