"""Which interface reaches a peer (``net/route.py``): the kernel's route to an address,
asked without sending anything, and the interface that holds the local address chosen."""

from __future__ import annotations

import psutil

from mlxceld.net.route import interface_ipv4, interface_of, interfaces, link_to


def test_a_loopback_peer_is_reached_on_the_loopback_interface() -> None:
    loopback = interface_of("127.0.0.1")
    assert loopback is not None and loopback in psutil.net_if_addrs()
    for peer in ("127.0.0.1", "127.0.0.3"):
        link = link_to(peer)
        assert link is not None and link.local.startswith("127.")
        assert link.interface == loopback, link
        assert link.to_json() == {"local": link.local, "interface": loopback}
    assert interface_ipv4(loopback) == "127.0.0.1"


def test_names_unknown_interfaces_and_unroutable_addresses_give_none() -> None:
    assert link_to("mac-1.local") is None  # a host name is not resolved here
    assert interface_ipv4("no-such-if0") is None
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: no interface holds it
    table = {"bridge0": ["fe80::1", "169.254.3.4"], "en0": []}
    assert interface_ipv4("bridge0", table) == "169.254.3.4"  # the first IPv4, not the v6
    assert interface_ipv4("en0", table) is None
    assert interface_of("169.254.3.4", table) == "bridge0"
    assert all(isinstance(a, list) for a in interfaces().values())
