"""Discovery between real daemons on 127.0.0.x: static peers, inventory, refusals, restart."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import pytest

from mlxceld import __version__
from mlxceld.net.route import interface_of
from mlxceld.wire import key_id

from helpers.cluster import POLL_WAIT_S, agent, by_address, settled, start, stop
from helpers.daemons import DaemonProc, Daemons
from helpers.waiting import wait_for


def nodes_json(d: DaemonProc) -> dict[str, Any]:
    out = d.ctl("cluster", "nodes", "--json")
    assert out.returncode == 0, out.stderr
    body: dict[str, Any] = json.loads(out.stdout)
    assert body["schema"] == "mlxctl.cluster_nodes/1"
    return body


@pytest.mark.slow
def test_static_peers_are_polled_for_their_inventory(daemons: Daemons) -> None:
    secret = secrets.token_hex(16).encode()
    b = start(daemons, "127.0.0.2", secret, name="b")
    c = start(daemons, "127.0.0.3", secret, name="c")
    stranger = start(daemons, "127.0.0.4", secrets.token_hex(16).encode(), name="x")
    dead = "127.0.0.5:9"  # nothing listens there
    peers = [agent(b), agent(c), agent(stranger), dead]
    a = start(daemons, "127.0.0.1", secret, "--cluster-peers", ",".join(peers),
              "--cluster-name", "lab-1", name="a")
    expected = {agent(b): "reachable", agent(c): "reachable", agent(stranger): "refused",
                dead: "unreachable"}
    rows = wait_for(lambda: settled(a, expected), POLL_WAIT_S, f"peer states {expected}",
                    every=0.2)
    listed = {r["address"]: (r["state"], r["node_id"]) for r in nodes_json(a)["nodes"]}
    assert listed == {k: (r["state"], r["node_id"]) for k, r in rows.items()}  # mlxctl --json

    for d in (b, c):
        row = rows[agent(d)]
        assert row["node_id"] == d.status()["daemon"]["node_id"]
        assert row["version"] == __version__
        assert row["key_id"] == key_id(secret).hex()
        assert 0 < row["memory_available"] <= row["memory_total"]
        assert row["source"] == "static" and row["error"] is None and row["last_seen"]
        inventory = row["inventory"]
        assert inventory["agent"] == agent(d) and inventory["model"] is None
        assert len(inventory["ports"]) == 3
    refused = rows[agent(stranger)]
    assert refused["error"].startswith("unknown_key_id: ")  # another secret, another key id
    assert refused["node_id"] is None and refused["memory_total"] is None
    assert rows[dead]["error"].startswith("unreachable: ")
    body = nodes_json(a)
    assert body["cluster"] == "lab-1" and body["discovery"]["running"] is True

    table = a.ctl("cluster", "nodes")
    assert table.returncode == 0, table.stderr
    assert "discovery static on 127.0.0.1:" in table.stdout
    line = next(x for x in table.stdout.splitlines() if x.startswith(row["node_id"]))
    assert "reachable" in line and "GiB" in line and "ago" in line and "static" in line
    units = row["inventory"]["compute_units"]  # the test daemons declare theirs
    loopback = interface_of("127.0.0.1")  # the peers are reached on it: its name is shown
    assert units == 1 and re.search(rf"GiB\s+1\s+{loopback}\s+reachable", line), line
    assert row["link"] == {"local": "127.0.0.1", "interface": loopback}
    assert f"{agent(stranger)}: unknown_key_id" in table.stdout
    assert secret.decode() not in a.stderr() + b.stderr() + stranger.stderr()


@pytest.mark.slow
def test_candidates_survive_a_restart(daemons: Daemons) -> None:
    secret = secrets.token_hex(16).encode()
    b = start(daemons, "127.0.0.2", secret, name="b")
    peer, node = agent(b), b.status()["daemon"]["node_id"]
    a = start(daemons, "127.0.0.1", secret, "--cluster-peers", peer, name="a")
    wait_for(lambda: settled(a, {peer: "reachable"}), POLL_WAIT_S, "b reachable", every=0.2)
    stop(a)
    stop(b)
    a.start("--cluster-peers", peer, "--agent-addr", "127.0.0.1:0")
    row = by_address(a)[peer]  # b is gone: what a knows of it comes from its database
    assert row["node_id"] == node and row["memory_total"] > 0
    row = wait_for(lambda: by_address(a)[peer]["state"] == "unreachable" and by_address(a)[peer],
                   POLL_WAIT_S, "b unreachable", every=0.2)
    assert row["last_seen"] and row["error"].startswith("unreachable: ")
    # A peer dropped from --cluster-peers is dropped from the table at the next start.
    stop(a)
    a.start("--agent-addr", "127.0.0.1:0")
    assert by_address(a) == {}


def test_no_secret_lists_nothing_and_says_why(daemons: Daemons) -> None:
    d = daemons.make().start("--cluster-peers", "127.0.0.2:19000")
    body = nodes_json(d)
    assert body["nodes"] == [] and body["discovery"]["running"] is False
    assert "no cluster secret" in body["discovery"]["error"]
    out = d.ctl("cluster", "nodes")
    assert out.returncode == 0 and "(not running)" in out.stdout


def test_mdns_between_daemons_on_loopback(daemons: Daemons) -> None:
    """Signed mDNS records on lo (see tests/discovery/test_mdns.py for why lo carries them)."""
    secret = secrets.token_hex(16).encode()
    flags = ("--cluster-discovery", "mdns", "--cluster-name", f"mdns-{secrets.token_hex(4)}")
    b = start(daemons, "127.0.0.2", secret, *flags, name="b")
    c = start(daemons, "127.0.0.3", secret, *flags, name="c")
    x = start(daemons, "127.0.0.4", secrets.token_hex(16).encode(), *flags, name="x")
    for me, other in ((b, c), (c, b)):
        rows = wait_for(lambda me=me, other=other: settled(me, {agent(other): "reachable"}),
                        POLL_WAIT_S, f"{agent(other)} reachable from {agent(me)}", every=0.2)
        row = rows[agent(other)]
        assert row["source"] == "mdns" and row["record_ts"] and row["memory_total"] > 0
        assert row["node_id"] == other.status()["daemon"]["node_id"]
        assert set(rows) == {agent(other)}  # neither itself nor x (another secret)
    assert by_address(x) == {}
    body = nodes_json(b)
    assert body["discovery"]["mode"] == "mdns" and body["discovery"]["error"] is None
    assert body["discovery"]["advertised"] == agent(b)
    # x's record, ignored and logged (x started last: its first announcement may come later)
    wait_for(lambda: "key id this node does not hold" in b.stderr(), POLL_WAIT_S,
             "b to log x's record as signed with a key it does not hold", every=0.2)
