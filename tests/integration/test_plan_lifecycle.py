"""A pushed plan's life on daemons run as a service manager runs them (`mlxceld --config FILE`
and nothing else): `mlxctl cluster activate` with stage ports from a configured range, the
coordinator stopped and started again serving the same plan (the peers' stage workers keep
their pids), again with pp_auto and another mesh (the plan resumed as it was, the change
said), then `mlxctl cluster deactivate` with one peer down, and nothing coming back
after any restart. Real daemons started by tests/helpers/deploy.py (agents on the wildcard host);
the coordinator names its peers 127.0.0.2 and 127.0.0.3."""

from __future__ import annotations

import secrets
from pathlib import Path

import psutil
import pytest

from helpers.cluster import ACTIVATE_S, POLL_WAIT_S, settled, stop
from helpers.daemons import READY_S, DaemonProc, Daemons, alive
from helpers.deploy import Host
from helpers.models import PROMPT, expected
from helpers.ports import free_port, free_ports
from helpers.router import complete
from helpers.waiting import wait_for

DEACTIVATE_CLI_S = 90.0  # the CLI's own bound (control.client.DEACTIVATE_TIMEOUT_S) fits
AGENT_UP_S = 20.0  # a restarted daemon's agent listener (and with it its resume decision)


def listening_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def names(d: DaemonProc) -> set[str]:
    return {w["name"] for w in d.status()["workers"]}


def restarted_idle(h: Host) -> None:
    """Start ``h`` again from its config file; wait until its agent listener (and the
    decision to resume, or not, taken as it starts) is up."""
    d = h.start().d
    wait_for(lambda: d.status()["agent"]["address"], AGENT_UP_S, f"{d.root}'s agent listener")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plan_outlives_a_coordinator_restart_until_deactivated(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    ports = free_ports(16)  # below the ephemeral range, this worker's own
    hosts = [Host(daemons, f"p{i}", secret=secret, serve={"model": str(model)},
                  daemon={"pp_peer": True, "stage_ports": f"{ports[0]}-{ports[-1]}"}).start()
             for i in (2, 3)]
    peers = [h.d for h in hosts]
    named = {p.root: h.address(f"127.0.0.{i}") for i, (p, h) in enumerate(zip(peers, hosts,
                                                                               strict=True), 2)}
    port = free_port("127.0.0.1")
    coord_host = Host(daemons, "c", secret=secret, serve={"port": port},
                      daemon={"cluster_peers": list(named.values())}).start()
    coord = coord_host.d
    wait_for(lambda: settled(coord, dict.fromkeys(named.values(), "reachable")), POLL_WAIT_S,
             "both peers polled", every=0.2)

    done = coord.ctl("cluster", "activate", "--model", str(model), "--stages", "2",
                     timeout=ACTIVATE_S)
    assert done.returncode == 0, (done.stdout, done.stderr, coord.stderr()[-3000:])
    daemons.note(coord)
    stage_pids = {}
    for p in peers:
        w = p.wait_worker("stage", timeout=READY_S, state="running")
        daemons.pids.add(w["pid"])
        stage_pids[p.root] = w["pid"]
        address = p.status()["cluster"]["address"]
        assert int(address.rpartition(":")[2]) in ports, address
        assert listening_ports(w["pid"]) and listening_ports(w["pid"]) <= set(ports)
    text = complete(port, "llama")
    assert text == expected(model, PROMPT, 8)

    # SIGTERM, then `mlxceld --config FILE` alone: the plan is served again, not pushed.
    old_router = coord.worker("router")["pid"]
    coord_host.restart()
    router = coord.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(router["pid"])
    assert router["pid"] != old_router
    bringup = coord.status()["bringup"]
    assert bringup["state"] == "active" and "resumed as decided (active)" in bringup["summary"]
    assert "config_differs" not in bringup, bringup
    assert complete(port, "llama") == text
    for p in peers:
        assert p.worker("stage")["pid"] == stage_pids[p.root]
        assert sum(e["kind"] == "stage.active" for e in p.events()) == 1  # loaded once

    # Restarted with pp_auto = 2 and mesh = "tp": the plan (planned with --mesh pp) is
    # resumed as it was, and the changed mesh is said: the log, an event, mlxctl status.
    coord_host.daemon_keys.update({"pp_auto": 2, "mesh": "tp"})
    coord_host.serve_keys["model"] = str(model)
    coord_host.write()
    coord_host.restart()
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    resumed = coord.status()["bringup"]
    said = "the plan was planned with --mesh pp, --mesh ([daemon] mesh) is now tp"
    assert resumed["epoch"] == bringup["epoch"] and resumed["config_differs"] == said, resumed
    differs = [e for e in coord.events() if e["kind"] == "bringup.config_differs"]
    assert len(differs) == 1 and said in differs[0]["message"], differs
    assert f"config differs: {said}" in coord.ctl("status").stdout
    assert said in coord.stderr() and "mlxctl cluster activate re-plans now" in coord.stderr()
    assert complete(port, "llama") == text
    for p in peers:
        assert p.worker("stage")["pid"] == stage_pids[p.root]  # nothing re-planned
    bringup = resumed
    for key in ("pp_auto", "mesh"):  # its next start: the config of before
        del coord_host.daemon_keys[key]
    del coord_host.serve_keys["model"]
    coord_host.write()

    # One peer down, then deactivate: the other stops its stage, the down one is named.
    (up, up_host), (down, down_host) = zip(peers, hosts, strict=True)
    down_agent = named[down.root]
    stop(down)
    gone = coord.ctl("cluster", "deactivate", timeout=DEACTIVATE_CLI_S)
    assert gone.returncode == 1, (gone.stdout, gone.stderr)
    assert f"{down_agent:22}" in gone.stderr and "unreachable: cannot connect" in gone.stderr
    assert f"plan {bringup['epoch']} deactivated: 1 of 2 stage(s) stopped" in gone.stderr
    assert f"stage-0  {named[up.root]:22}" in gone.stdout and "deactivated" in gone.stdout
    assert "stage" not in names(up) and "router" not in names(coord)
    assert not alive(stage_pids[up.root]) and not alive(router["pid"])  # memory freed
    on_peer = up.ctl("cluster", "deactivate")
    assert on_peer.returncode == 1 and "--pp-peer" in on_peer.stderr, on_peer.stderr
    assert coord.status()["serving"] is None
    assert up.status()["assignment"]["state"] == "deactivated"
    assert up.ctl("status").returncode == 0 and coord.ctl("status").returncode == 0
    assert coord.status()["bringup"]["state"] == "deactivated"

    # Nothing comes back: the down peer asks the coordinator before bringing its stage back,
    # the told peer remembers, the coordinator does not resume a deactivated plan.
    restarted_idle(down_host)
    wait_for(lambda: (down.status()["assignment"] or {}).get("state") == "deactivated",
             AGENT_UP_S, "the restarted peer to learn of the deactivation")
    assert "stage" not in names(down)
    stop(up)
    restarted_idle(up_host)
    assert "stage" not in names(up) and up.status()["assignment"]["state"] == "deactivated"
    stop(coord)
    restarted_idle(coord_host)
    assert "router" not in names(coord) and coord.status()["serving"] is None
    assert coord.status()["bringup"]["state"] == "deactivated"
