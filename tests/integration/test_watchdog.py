"""The supervisor's watchdog on real workers: alive, with work, no progress -> restarted.

The echo role stands in for a stage whose compute hangs: ``busy`` makes it report work
in hand (its ticks are its steps), ``stall_after_s`` stops its ticks while its control
channel keeps answering, so the liveness probes pass and only the watchdog can see it.
"""

from __future__ import annotations

import time

from helpers.daemons import FAST_POLICY, Daemons
from helpers.waiting import wait_for

STALL_TIMEOUT_S = 2.0
HEALTH_S = 0.5  # FAST_POLICY's health_interval_s
CONFIG = FAST_POLICY + f"""
stall_timeout_s = {STALL_TIMEOUT_S}

[workers.stuck]
role = "echo"
options = {{ interval_s = 0.1, busy = true, stall_after_s = 1.0 }}

[workers.steady]
role = "echo"
options = {{ interval_s = 0.1, busy = true }}

[workers.idle]
role = "echo"
options = {{ interval_s = 0.1, stall_after_s = 0.5 }}
"""


def test_watchdog_restarts_a_busy_worker_that_makes_no_progress(daemons: Daemons) -> None:
    d = daemons.make(CONFIG).start()
    first = d.wait_worker("stuck", state="running")["pid"]
    ready = time.monotonic()
    daemons.pids.add(first)
    stopping = wait_for(lambda: [e for e in d.events() if e["subject"] == "stuck"
                                 and e["kind"] == "worker.stopping"], 30, "stuck stopped")[0]
    took = time.monotonic() - ready
    # Its last step ~1 s after ready, then stall_timeout_s, then up to one probe interval
    # (plus the probe itself and a loaded machine's slack).
    print(f"watchdog acted {took:.2f} s after ready (bound: 1 + {STALL_TIMEOUT_S} + "
          f"{HEALTH_S} s and slack)")
    assert took < 1.0 + STALL_TIMEOUT_S + HEALTH_S + 10.0
    reason = stopping["data"]["reason"]
    assert reason.startswith("restarting: watchdog: it had work but made no progress for ")
    assert f"(stall_timeout_s {STALL_TIMEOUT_S:g};" in reason and "steps done" in reason
    backoff = wait_for(lambda: [e for e in d.events() if e["subject"] == "stuck"
                                and e["kind"] == "worker.backoff"], 15, "stuck in backoff")[0]
    assert backoff["data"]["cause"] == "watchdog"
    assert "watchdog" in backoff["message"]
    again = wait_for(lambda: (w := d.worker("stuck"))["state"] == "running"
                     and w["pid"] not in (first, None) and w, 20, "stuck restarted")
    daemons.pids.add(again["pid"])
    assert again["restarts"] >= 1
    # A busy worker that steps, and an idle one that stopped stepping, are left alone.
    for name in ("steady", "idle"):
        w = d.worker(name)
        assert (w["state"], w["restarts"]) == ("running", 0), w
        assert not [e for e in d.events() if e["subject"] == name
                    and e["kind"] == "worker.stopping"]
