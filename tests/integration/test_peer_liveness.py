"""The failure detector between real daemons on 127.0.0.x: a peer daemon stopped with
SIGSTOP (a host asleep: its sockets stay open, nothing answers) turns suspect, then dead,
within the configured bounds, while the other peer stays alive; SIGCONT makes it alive
again with no operator action; the verdict is shown by `mlxctl cluster nodes` (and
``--json``), appended as events, and kept across a restart of the observing daemon."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from helpers.cluster import agent, by_address, start, stop
from helpers.daemons import DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.waiting import wait_for

log = logging.getLogger(__name__)

PING_S, SUSPECT_S, DEAD_S = 0.25, 1.0, 2.0
DETECTOR = f"""
[daemon]
peer_ping_interval_s = {PING_S}
peer_suspect_after_s = {SUSPECT_S}
peer_dead_after_s = {DEAD_S}
"""
SLACK_S = 1.5  # a loaded CI machine: the loop, the dial and this test's polling
TOLERANCE_S = 0.3
RUNS = 3
WAIT_S = 30.0  # generous: the assertions on time are made on the recorded times


def liveness(d: DaemonProc, peer: str) -> dict[str, Any] | None:
    row = by_address(d).get(peer) or {}
    live: dict[str, Any] | None = row.get("liveness")
    return live


def state_is(d: DaemonProc, peer: str, state: str) -> dict[str, Any] | None:
    live = liveness(d, peer)
    return live if live and live["state"] == state else None


@contextmanager
def stopped(d: DaemonProc) -> Iterator[float]:
    """``d``'s daemon stopped by SIGSTOP (its wall time given); SIGCONT whatever happens."""
    os.kill(d.pid, signal.SIGSTOP)
    try:
        yield time.time()
    finally:
        os.kill(d.pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_stopped_peer_is_suspect_then_dead_then_alive_again(daemons: Daemons) -> None:
    secret = secrets.token_hex(16).encode()
    b = start(daemons, "127.0.0.2", secret, name="b")
    c = start(daemons, "127.0.0.3", secret, name="c")
    pb, pc = agent(b), agent(c)
    node_b = b.status()["daemon"]["node_id"]
    a = daemons.make(DETECTOR, name="a")
    a.start("--cluster-secret-file", str(secret_file(a.root, secret)),
            "--agent-addr", "127.0.0.1:0", "--cluster-peers", f"{pb},{pc}")
    for p in (pb, pc):
        wait_for(lambda p=p: state_is(a, p, "alive"), WAIT_S, f"{p} alive", every=0.1)

    # per run: the threshold crossed (the row's since) and when the daemon noticed it (the
    # event's time), both from the stop (SIGCONT for alive)
    since: dict[str, list[float]] = {"suspect": [], "dead": [], "alive": []}
    noticed: dict[str, list[float]] = {"suspect": [], "dead": [], "alive": []}
    for _ in range(RUNS):
        before = max(e["id"] for e in a.events(1))
        with stopped(b) as t0:
            dead = wait_for(lambda: state_is(a, pb, "dead"), WAIT_S, f"{pb} dead", every=0.05)
            # the other peer was never held up by the silent one
            other = liveness(a, pc)
            assert other is not None and other["state"] == "alive"
            assert time.time() - other["last_answer"] < SUSPECT_S
        t1 = time.time()
        back = wait_for(lambda: state_is(a, pb, "alive"), WAIT_S, f"{pb} alive", every=0.05)
        events = [e for e in a.events(50) if e["data"].get("address") == pb
                  and e["id"] > before]
        assert [e["kind"] for e in events] == ["peer.suspect", "peer.dead", "peer.alive"], events
        for e in events:
            state, origin = e["data"]["new"], t1 if e["kind"] == "peer.alive" else t0
            since[state].append(e["data"]["since"] - origin)
            noticed[state].append(e["ts"] - origin)
        assert events[1]["data"]["since"] == dead["since"]
        assert dead["reason"].startswith(f"no answer to pings for {DEAD_S:g} s"), dead
        assert back["reason"].startswith("answered again after"), back
    log.warning("after SIGSTOP (ping %g s, suspect %g s, dead %g s), %d runs, p50/max in s: %s",
                PING_S, SUSPECT_S, DEAD_S, RUNS, "; ".join(
                    f"{state} since {statistics.median(since[state]):.2f}/"
                    f"{max(since[state]):.2f}, noticed {statistics.median(noticed[state]):.2f}/"
                    f"{max(noticed[state]):.2f}" for state in since))
    # within the documented bounds: silence counts from the last answer, about one ping
    # interval before the stop at most (TOLERANCE_S: a round trip, or a pong read just after)
    assert all(SUSPECT_S - PING_S - TOLERANCE_S <= s <= SUSPECT_S + TOLERANCE_S
               for s in since["suspect"])
    assert all(DEAD_S - PING_S - TOLERANCE_S <= s <= DEAD_S + TOLERANCE_S for s in since["dead"])
    assert all(s <= SUSPECT_S + SLACK_S for s in noticed["suspect"])
    assert all(s <= DEAD_S + SLACK_S for s in noticed["dead"])
    assert all(s <= PING_S + SLACK_S for s in noticed["alive"])

    # Shown by mlxctl, persisted across a restart of the observer, alive again on SIGCONT.
    with stopped(b):
        dead = wait_for(lambda: state_is(a, pb, "dead"), WAIT_S, f"{pb} dead", every=0.05)
        out = a.ctl("cluster", "nodes", "--json")
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["detector"] == {"running": True, "ping_interval_s": PING_S,
                                    "suspect_after_s": SUSPECT_S, "dead_after_s": DEAD_S}
        shown = {n["address"]: n["liveness"] for n in body["nodes"]}
        assert shown[pb]["state"] == "dead" and shown[pb]["since"] == dead["since"]
        assert shown[pb]["node_id"] == node_b
        assert shown[pc]["state"] == "alive"
        table = a.ctl("cluster", "nodes")
        assert table.returncode == 0, table.stderr
        assert "suspect after 1 s, dead after 2 s" in table.stdout
        line = next(x for x in table.stdout.splitlines() if f" {pb} " in x)
        assert " dead " in line and " ago)" in line, table.stdout
        assert f"{pb}: dead: no answer to pings for 2 s" in table.stdout

        stop(a)
        a.start("--cluster-peers", f"{pb},{pc}", "--agent-addr", "127.0.0.1:0")
        kept = liveness(a, pb)
        assert kept is not None and kept["state"] == "dead", kept
        assert kept["since"] == dead["since"] and kept["reason"] == dead["reason"]
    wait_for(lambda: state_is(a, pb, "alive"), WAIT_S, f"{pb} alive after the restart",
             every=0.05)
