"""A real daemon whose control socket file is deleted: bound again within the documented
bound (``SOCKET_CHECK_S``), at once on SIGHUP; a second daemon on its state dir is told the
holder's pid and how to stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from mlxceld.control.keeper import SOCKET_CHECK_S
from mlxceld.errors import DaemonNotRunning

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons
from helpers.waiting import wait_for

SLACK_S = 1.5  # the bind, the client's poll and a loaded machine, over the documented bound


def answers(d: DaemonProc) -> bool:
    try:
        d.api(lambda c: c.version())
    except DaemonNotRunning:
        return False
    return True


def restored(d: DaemonProc) -> list[dict[str, Any]]:
    return [e for e in d.events() if e["kind"] == "daemon.socket_restored"]


def back_after(d: DaemonProc, deadline_s: float) -> float:
    """Seconds until the daemon answers on its socket path again."""
    start = time.monotonic()
    wait_for(lambda: answers(d), deadline_s, f"the control socket {d.socket} to answer again",
             every=0.02)
    return time.monotonic() - start


def test_a_deleted_control_socket_is_bound_again(daemons: Daemons) -> None:
    d = daemons.make(FAST_POLICY).start()
    second = subprocess.run(
        [sys.executable, "-m", "mlxceld", "--state-dir", str(d.state_dir),
         "--socket", str(d.root / "run" / "other.sock"), "--agent-addr", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60)
    assert second.returncode == 1, second.stderr
    assert f"another mlxceld (pid {d.pid}) is already running" in second.stderr
    assert (f"hint: stop it first: mlxctl --socket {d.socket} stop, or kill -TERM {d.pid}"
            in second.stderr)

    d.socket.unlink()
    took = back_after(d, SOCKET_CHECK_S + 30)
    assert took <= SOCKET_CHECK_S + SLACK_S, f"bound again after {took:.2f} s"
    assert d.ctl("status").returncode == 0
    [event] = restored(d)
    assert event["data"]["trigger"] == "periodic check"
    assert event["message"] == f"the control socket {d.socket} was deleted; bound again"

    # Just after a periodic check the next is SOCKET_CHECK_S away: SIGHUP comes first.
    d.socket.unlink()
    os.kill(d.pid, signal.SIGHUP)
    took = back_after(d, 30)
    assert restored(d)[-1]["data"]["trigger"] == "SIGHUP", restored(d)
    assert took < SOCKET_CHECK_S, f"bound again {took:.2f} s after SIGHUP"
    assert d.ctl("stop").returncode == 0
    assert d.proc is not None and d.proc.wait(timeout=30) == 0
    assert not d.socket.exists()
