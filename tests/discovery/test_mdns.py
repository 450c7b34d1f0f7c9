"""mDNS between AsyncZeroconf instances in one process, on the loopback interface.

Multicast on ``lo`` works here although ``ip link show lo`` has no MULTICAST
flag: zeroconf told to use 127.0.0.1 joins 224.0.0.251 there and sets
IP_MULTICAST_IF to it, and IP_MULTICAST_LOOP (on by default) delivers every
packet to each socket of the group on this host, other processes included.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from mlxceld.discovery.candidates import CandidateTable
from mlxceld.discovery.mdns import MdnsDiscovery, advertised_ip, interfaces_for
from mlxceld.net.resolve import ResolveError
from mlxceld.net.route import interface_of

from helpers.keys import keyring

SEEN_WITHIN_S = 15.0  # registration probes take about 2 s, a browse answer is quick


def test_interface_and_advertised_address_choices() -> None:
    assert interfaces_for("127.0.0.2")[0] == ["127.0.0.1"]
    assert interfaces_for("10.1.2.3")[0] == ["10.1.2.3"]
    assert advertised_ip("127.0.0.2") == "127.0.0.2"
    assert advertised_ip("0.0.0.0") != "0.0.0.0"
    # An agent on a host name advertises the address the name resolves to.
    named = MdnsDiscovery(CandidateTable(), keyring(b"x" * 16), node_id="n", cluster="c",
                          agent_address="localhost:1")
    assert named.advertised == "127.0.0.1:1"
    with pytest.raises(ResolveError, match=r"'no-such-host\.invalid'"):
        MdnsDiscovery(CandidateTable(), keyring(b"x" * 16), node_id="n", cluster="c",
                      agent_address="no-such-host.invalid:1")


def test_daemons_on_loopback_find_each_other_and_ignore_strangers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxceld.discovery import mdns

    monkeypatch.setattr(mdns, "ANNOUNCE_EVERY_S", 1.0)  # see a refresh without waiting 15 s
    cluster = f"mdns-test-{secrets.token_hex(4)}"  # other runs on this host stay apart
    secret = secrets.token_bytes(32)
    run = secrets.token_hex(3)  # node ids (instance names) of this run only
    ids = {x: f"node-{x}-{run}" for x in "bcxy"}

    async def main() -> None:
        tables = {x: CandidateTable(node_id=n) for x, n in ids.items()}
        nodes = [
            MdnsDiscovery(tables["b"], keyring(secret), node_id=ids["b"], cluster=cluster,
                          agent_address="127.0.0.2:19002"),
            MdnsDiscovery(tables["c"], keyring(secret), node_id=ids["c"], cluster=cluster,
                          agent_address="127.0.0.3:19003"),
            # Another secret, and another cluster name: both announce, neither is a candidate.
            MdnsDiscovery(tables["x"], keyring(secrets.token_bytes(32)), node_id=ids["x"],
                          cluster=cluster, agent_address="127.0.0.4:19004"),
            MdnsDiscovery(tables["y"], keyring(secret), node_id=ids["y"],
                          cluster=cluster + "-other", agent_address="127.0.0.5:19005"),
        ]
        tasks = [asyncio.create_task(n.run()) for n in nodes]
        try:
            deadline = time.monotonic() + SEEN_WITHIN_S
            while time.monotonic() < deadline:
                if (tables["b"].addresses() == ["127.0.0.3:19003"]
                        and tables["c"].addresses() == ["127.0.0.2:19002"]
                        and tables["y"].addresses() == []):
                    break
                await asyncio.sleep(0.2)
            assert tables["b"].addresses() == ["127.0.0.3:19003"], [
                n.error for n in nodes]
            assert tables["c"].addresses() == ["127.0.0.2:19002"]
            row = tables["b"].get("127.0.0.3:19003")
            assert row is not None
            assert (row.source, row.state, row.node_id) == ("mdns", "discovered", ids["c"])
            assert row.record_ts is not None and abs(row.record_ts - time.time()) < 30
            assert tables["x"].addresses() == [] and tables["y"].addresses() == []
            assert all(n.error is None for n in nodes)
            first = row.record_ts
            while time.monotonic() < deadline + 5:
                row = tables["b"].get("127.0.0.3:19003")
                if row is not None and row.record_ts is not None and row.record_ts > first:
                    break
                await asyncio.sleep(0.2)
            assert row is not None and row.record_ts is not None and row.record_ts > first
        finally:
            for task in tasks:
                task.cancel()
            ended = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(e, asyncio.CancelledError) for e in ended), ended

    asyncio.run(main())


def test_an_agent_on_every_interface_announces_its_cluster_interface_and_is_found() -> None:
    """``[daemon] cluster_interface`` (here the loopback interface, whatever its name on
    this system): an agent on 0.0.0.0 announces that interface's address, runs mDNS on it,
    and a peer finds it there; an interface with no address is reported and the default
    address announced."""
    loopback = interface_of("127.0.0.1")
    assert loopback is not None
    missing = MdnsDiscovery(CandidateTable(), keyring(b"x" * 16), node_id="n", cluster="c",
                            agent_address="0.0.0.0:1", interface="no-such-if0")
    assert missing.advertised == f"{advertised_ip('0.0.0.0')}:1"
    assert missing.error is not None and "'no-such-if0' has no IPv4 address" in missing.error
    assert "interfaces with one: " in missing.error and loopback in missing.error
    # an agent on one address announces that one: the interface is not looked at
    one = MdnsDiscovery(CandidateTable(), keyring(b"x" * 16), node_id="n", cluster="c",
                        agent_address="127.0.0.9:1", interface="no-such-if0")
    assert one.advertised == "127.0.0.9:1" and one.error is None

    cluster = f"mdns-if-{secrets.token_hex(4)}"
    secret = secrets.token_bytes(32)
    run = secrets.token_hex(3)
    ids = {x: f"node-{x}-{run}" for x in "bc"}

    async def main() -> None:
        tables = {x: CandidateTable(node_id=n) for x, n in ids.items()}
        b = MdnsDiscovery(tables["b"], keyring(secret), node_id=ids["b"], cluster=cluster,
                          agent_address="0.0.0.0:19022", interface=loopback)
        c = MdnsDiscovery(tables["c"], keyring(secret), node_id=ids["c"], cluster=cluster,
                          agent_address="127.0.0.3:19023")
        assert b.advertised == "127.0.0.1:19022" and b.error is None
        tasks = [asyncio.create_task(n.run()) for n in (b, c)]
        try:
            deadline = time.monotonic() + SEEN_WITHIN_S
            while time.monotonic() < deadline and not (
                    tables["c"].addresses() == ["127.0.0.1:19022"]
                    and tables["b"].addresses() == ["127.0.0.3:19023"]):
                await asyncio.sleep(0.2)
            assert tables["c"].addresses() == ["127.0.0.1:19022"], (b.error, c.error)
            assert tables["b"].addresses() == ["127.0.0.3:19023"], (b.error, c.error)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
