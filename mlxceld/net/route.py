"""Which network interface reaches a peer, and an interface's own address.

A host with several links (a Thunderbolt bridge beside Ethernet or Wi-Fi) reaches a
peer's address through whichever interface the kernel's routing table picks for it.
``link_to(ip)`` asks the kernel without sending anything (a UDP socket "connected" to
the address: the route is chosen, no packet leaves) and names the interface that holds
the local address chosen (``psutil.net_if_addrs``). ``mlxctl cluster nodes`` shows it per
peer, so an operator sees which link each peer is reached on.

``interface_ipv4(name)`` is the first IPv4 address of the interface ``name``: the address
a daemon announces when ``[daemon] cluster_interface`` names the link its cluster's traffic
should use (``config/interface.py``, ``discovery/mdns.py``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from dataclasses import dataclass

import psutil

from mlxceld.types import JSON


@dataclass(frozen=True)
class Link:
    """The route to a peer: the local address the kernel would send from, and the
    interface holding it (None when no interface lists that address)."""

    local: str
    interface: str | None

    def to_json(self) -> JSON:
        return {"local": self.local, "interface": self.interface}


def interfaces() -> dict[str, list[str]]:
    """Each interface's addresses (IPv4 and IPv6, without a zone), by name."""
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        out[name] = [a.address.split("%", 1)[0] for a in addrs
                     if a.family in (socket.AF_INET, socket.AF_INET6)]
    return out


def interface_of(ip: str, table: dict[str, list[str]] | None = None) -> str | None:
    """The interface that holds the address ``ip``; None when none does."""
    for name, addresses in (table if table is not None else interfaces()).items():
        if ip in addresses:
            return name
    return None


def interface_ipv4(name: str, table: dict[str, list[str]] | None = None) -> str | None:
    """The first IPv4 address of the interface ``name``; None when it has none (or there
    is no such interface)."""
    for address in (table if table is not None else interfaces()).get(name, []):
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(address).version == 4:
                return address
    return None


def link_to(host: str, table: dict[str, list[str]] | None = None) -> Link | None:
    """The route the kernel picks to the IP literal ``host``; None for a host name (not
    resolved here: this must not block) or an address no route reaches."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((str(ip), 9))  # a UDP "connect" picks the route and sends nothing
            local = str(s.getsockname()[0]).split("%", 1)[0]
    except OSError:
        return None
    return Link(local, interface_of(local, table))
