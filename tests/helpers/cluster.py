"""Real daemons as the hosts of a cluster on 127.0.0.x: each started with the cluster secret
and its agent's address, its agent and candidates read back, a plan activated by mlxctl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers.daemons import DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.ports import free_port
from helpers.waiting import wait_for

POLL_WAIT_S = 30.0  # a first poll starts at once and takes at most 5 s + 5 s
ACTIVATE_S = 300.0  # the CLI's own waits (push, then the router) fit well inside


def start(daemons: Daemons, ip: str, secret: bytes, *extra: str, name: str = "d",
          env: dict[str, str] | None = None, config: str = "") -> DaemonProc:
    """A daemon holding ``secret``, its agent on ``ip`` (a port of its own choosing);
    ``config``: its mlxceld.toml."""
    d = daemons.make(config, name=name)
    return d.start("--cluster-secret-file", str(secret_file(d.root, secret)),
                   "--agent-addr", f"{ip}:0", *extra, env=env)


def agent(d: DaemonProc) -> str:
    """The address ``d``'s agent listens on."""
    address = d.status()["agent"]["address"]
    assert address, d.status()["agent"]
    return str(address)


def stop(d: DaemonProc) -> None:
    """``mlxctl stop``, and the daemon exits 0."""
    assert d.ctl("stop").returncode == 0
    assert d.proc is not None and d.proc.wait(timeout=20) == 0


def by_address(d: DaemonProc) -> dict[str, dict[str, Any]]:
    """The candidates through the control API in-process (mlxctl's client, no subprocess)."""
    return {n["address"]: n for n in d.api(lambda c: c.cluster_nodes())["nodes"]}


def settled(d: DaemonProc, expected: dict[str, str]) -> dict[str, dict[str, Any]] | None:
    """The candidates, once each address in ``expected`` has its state there; else None."""
    rows = by_address(d)
    ok = all(rows.get(a, {}).get("state") == s for a, s in expected.items())
    return rows if ok else None


def coordinator(daemons: Daemons, secret: bytes, peers: list[DaemonProc], config: str = ""
                ) -> tuple[DaemonProc, int, tuple[str, ...]]:
    """A coordinator on 127.0.0.1 over ``peers`` (``--cluster-peers``: their agents),
    started and seeing each of them reachable; its router's port, and its flags (a restart
    starts it with them); ``config``: its mlxceld.toml."""
    port = free_port("127.0.0.1")
    coord = daemons.make(config, name="c")
    flags = ("--cluster-secret-file", str(secret_file(coord.root, secret)),
             "--agent-addr", f"127.0.0.1:{free_port('127.0.0.1')}", "--port", str(port),
             "--cluster-peers", ",".join(agent(p) for p in peers))
    coord.start(*flags)
    want = {agent(p): "reachable" for p in peers}
    wait_for(lambda: settled(coord, want), POLL_WAIT_S, f"peers {want}", every=0.2)
    return coord, port, flags


def activate(coord: DaemonProc, model: Path, stages: int, *extra: str) -> str:
    """``mlxctl cluster activate`` on ``coord`` (``extra``: more of its flags, ``--mesh
    tp``), which must succeed; what it printed."""
    out = subprocess.run(
        [sys.executable, "-m", "mlxctl", "--socket", str(coord.socket), "cluster", "activate",
         "--model", str(model), "--stages", str(stages), *extra],
        capture_output=True, text=True, timeout=ACTIVATE_S)
    assert out.returncode == 0, (out.stdout, out.stderr, coord.stderr()[-3000:])
    return out.stdout
