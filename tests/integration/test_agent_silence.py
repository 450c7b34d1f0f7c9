"""The agent listener holds no connection from a silent peer: daemon A watches daemon B
(its heartbeats and inventory polls dial B's agent listener); A stopped with SIGSTOP (a host
asleep: no RST, its sockets stay open) has its connections at B dropped within B's bound
(``peer_suspect_after_s``), B's log saying so; SIGCONT, and A dials B again by itself.
The times measured are logged (p50/max over the runs)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import statistics
import time
from collections.abc import Callable

import psutil

from helpers.cluster import agent, by_address
from helpers.daemons import DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.waiting import wait_for

log = logging.getLogger(__name__)

PING_S, SUSPECT_S, DEAD_S = 0.25, 1.0, 3.0
DETECTOR = f"""
[daemon]
peer_ping_interval_s = {PING_S}
peer_suspect_after_s = {SUSPECT_S}
peer_dead_after_s = {DEAD_S}
"""
SLACK_S = 1.5  # a loaded machine: the loop's timers and this test's polling
RUNS = 3
WAIT_S = 30.0  # generous: the assertion on time is made on the measured time
SETTLE_S = 0.5  # a connection this old is past its handshake (milliseconds on loopback)


def ports_from(d: DaemonProc, ip: str, port: int) -> set[int]:
    """The source ports of the established TCP connections of ``d``'s daemon on ``port``
    from ``ip``."""
    return {c.raddr.port for c in psutil.Process(d.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
            and c.raddr and c.raddr.ip == ip}


def connections_from(d: DaemonProc, ip: str, port: int) -> int:
    """Established TCP connections of ``d``'s daemon on ``port`` from ``ip``."""
    return len(ports_from(d, ip, port))


def settled_connection(d: DaemonProc, ip: str, port: int) -> Callable[[], bool]:
    """A predicate: some connection from ``ip`` was seen at the last poll ``SETTLE_S`` or
    more ago and is still there. A connection just dialled may still be in its handshake,
    which the listener's handshake deadline drops (its own log line), not the heartbeat:
    a peer stopped then would not test the heartbeat."""
    seen: dict[int, float] = {}

    def settled() -> bool:
        now = time.monotonic()
        ports = ports_from(d, ip, port)
        for gone in set(seen) - ports:
            del seen[gone]
        for p in ports:
            seen.setdefault(p, now)
        return any(now - at >= SETTLE_S for at in seen.values())
    return settled


def start(daemons: Daemons, name: str, ip: str, secret: bytes, *extra: str) -> DaemonProc:
    d = daemons.make(DETECTOR, name=name)
    return d.start("--cluster-secret-file", str(secret_file(d.root, secret)),
                   "--agent-addr", f"{ip}:0", *extra)


def test_a_stopped_peer_holds_no_agent_connection(daemons: Daemons) -> None:
    secret = secrets.token_hex(16).encode()
    b = start(daemons, "b", "127.0.0.2", secret)
    pb = agent(b)
    port_b = int(pb.rsplit(":", 1)[1])
    a = start(daemons, "a", "127.0.0.1", secret, "--cluster-peers", pb)
    wait_for(lambda: (by_address(a).get(pb) or {}).get("liveness", {}).get("state") == "alive",
             WAIT_S, f"{pb} alive at a", every=0.1)
    # Two daemons of one machine, neither told its node id: each has its own (the host name
    # and a suffix of its state dir's node, tests/state/test_state.py), and a knows b's.
    ids = [d.status()["daemon"]["node_id"] for d in (a, b)]
    assert ids[0] != ids[1], ids
    assert by_address(a)[pb]["node_id"] == ids[1]

    noticed: list[float] = []
    for run in range(RUNS):
        wait_for(settled_connection(b, "127.0.0.1", port_b), WAIT_S,
                 "a's heartbeat connection at b, past its handshake", every=0.05)
        os.kill(a.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(lambda: connections_from(b, "127.0.0.1", port_b) == 0, WAIT_S,
                     "b to drop the stopped a's connections", every=0.02)
            noticed.append(time.monotonic() - stopped)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        wait_for(lambda run=run: b.stderr().count("is silent: nothing heard from") > run,
                 WAIT_S, "b's log line for the silent peer")
        # back: a dials b again with no operator action, and b keeps that connection
        wait_for(lambda: connections_from(b, "127.0.0.1", port_b), WAIT_S,
                 "a connected to b again", every=0.05)
    line = next(x for x in b.stderr().splitlines() if "is silent: nothing heard from" in x)
    assert f"agent peer {agent(a)}" in line, line
    log.warning("agent connections of a SIGSTOPped peer dropped after (bound %g s), %d runs: "
                "p50 %.2f s, max %.2f s", SUSPECT_S, RUNS, statistics.median(noticed),
                max(noticed))
    assert all(s <= SUSPECT_S + SLACK_S for s in noticed), noticed
    time.sleep(3 * SUSPECT_S)  # a peer that answers keeps its connection: nothing more dropped
    assert b.stderr().count("is silent: nothing heard from") == RUNS
    assert connections_from(b, "127.0.0.1", port_b)
