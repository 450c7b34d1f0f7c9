"""`mlxctl cluster link-test` between real daemons on 127.0.0.x: by node id, by address
and by host name, its figures present and coherent (the bytes moved are those asked), and
a peer whose daemon stopped named with exit 1 within the dial's bound."""

from __future__ import annotations

import json
import secrets
import time

from mlxceld.net.link import CONNECT_S
from mlxctl.schemas import schema_of

from helpers.cluster import agent, by_address, start, stop
from helpers.daemons import DaemonProc, Daemons
from helpers.jsonschema_lite import errors
from helpers.waiting import wait_for

# mlxctl's own start (an interpreter and its imports) beside the dial's bound, loaded host
CTL_S = 20.0


def link_test(d: DaemonProc, peer: str, *args: str) -> dict[str, object]:
    out = d.ctl("cluster", "link-test", peer, "--json", *args, timeout=120)
    assert out.returncode == 0, (out.stdout, out.stderr, d.stderr()[-2000:])
    body = json.loads(out.stdout)
    assert not errors(body, schema_of("cluster_link_test")), errors(
        body, schema_of("cluster_link_test"))
    return dict(body)


def coherent(body: dict[str, object], pings: int, mib: int) -> None:
    rtt = body["rtt_ms"]
    assert isinstance(rtt, dict) and rtt["count"] == pings, rtt
    assert 0 < rtt["min"] <= rtt["median"] <= rtt["p90"] <= rtt["max"], rtt
    for way in ("sent", "received"):
        t = body[way]
        assert isinstance(t, dict) and t["bytes"] == mib << 20, (way, t)
        assert t["seconds"] > 0 and t["mb_per_s"] > 0, (way, t)
        assert abs(t["mb_per_s"] - t["bytes"] / 1e6 / t["seconds"]) < 0.01 * t["mb_per_s"]
    assert body["chunk_bytes"] == 1 << 20


def test_link_test_by_node_id_address_and_host_name(daemons: Daemons) -> None:
    secret = secrets.token_hex(16).encode()
    b = start(daemons, "127.0.0.3", secret, name="b")
    c = start(daemons, "127.0.0.1", secret, name="c")  # "localhost" is 127.0.0.1 only
    b_addr = agent(b)
    a = start(daemons, "127.0.0.2", secret, "--cluster-peers", b_addr, name="a")
    wait_for(lambda: by_address(a).get(b_addr, {}).get("state") == "reachable", 30,
             f"{b_addr} reachable")
    node = by_address(a)[b_addr]["node_id"]

    by_id = link_test(a, node, "--pings", "10", "--size", "4")
    assert (by_id["peer"], by_id["address"], by_id["node_id"]) == (node, b_addr, node)
    coherent(by_id, 10, 4)

    text = a.ctl("cluster", "link-test", b_addr, "--pings", "3", "--size", "1")
    assert text.returncode == 0, text.stderr
    assert f"link with {b_addr}, node {node}" in text.stdout, text.stdout
    assert "1.0 MB in" in text.stdout and "(3 pings)" in text.stdout, text.stdout

    c_port = agent(c).rsplit(":", 1)[1]
    by_name = link_test(a, f"localhost:{c_port}", "--pings", "3", "--size", "2")
    assert by_name["address"] == f"localhost:{c_port}" and by_name["node_id"] is None
    coherent(by_name, 3, 2)

    stop(c)
    began = time.monotonic()
    gone = a.ctl("cluster", "link-test", f"localhost:{c_port}", timeout=60)
    assert time.monotonic() - began < CONNECT_S + CTL_S
    assert gone.returncode == 1, (gone.stdout, gone.stderr)
    assert f"cannot reach peer localhost:{c_port}" in gone.stderr, gone.stderr

    unknown = a.ctl("cluster", "link-test", "no such node!", "--json")
    assert unknown.returncode == 1
    assert json.loads(unknown.stdout)["error"]["code"] == "unknown_node", unknown.stdout
    too_big = a.ctl("cluster", "link-test", node, "--size", "65")
    assert too_big.returncode == 2 and "--size" in too_big.stderr, too_big.stderr
