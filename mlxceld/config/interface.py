"""``[daemon] cluster_interface``: the network interface the cluster's traffic should use.

A host with several links to its peers (a Thunderbolt bridge and Ethernet, or Ethernet
and Wi-Fi) is reached on the address it announces. With ``cluster_interface = "bridge0"``
and an agent on every interface (``agent_addr = "0.0.0.0:PORT"``, the default), the
daemon announces that interface's IPv4 address in its mDNS record, so that its peers dial
it over that link (``discovery/mdns.py``); without it, the address of the default route's
interface is announced. ``mlxctl cluster nodes`` shows, for each peer, the interface it is
reached on (``net/route.py``).

The name is checked here for its form only: the interface may not be up yet when the
daemon starts (a Thunderbolt bridge comes up with its cable), so one without an IPv4
address is reported by discovery (``mlxctl cluster nodes``, the log) and the default
address announced until it has one. An agent on one address (``agent_addr`` with a
specific IP or a host name) announces that address: naming an interface beside it is
refused, naming both keys. Static peers (``cluster_peers``) are dialled at the addresses
listed: list each peer's address on the link wanted. A reload that changes the key
takes effect at the next start (discovery runs from the agent's start).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.wire.address import parse_address

KEY: Final = "cluster_interface"
MAX_NAME: Final = 64


def cluster_interface(daemon: Mapping[str, Any], agent_addr: str, where: str) -> str | None:
    """The Config field ``cluster_interface`` from [daemon] (``agent_addr``: the agent
    address chosen, flag or key); None when not set."""
    if KEY not in daemon:
        return None
    value = daemon[KEY]
    what = f"{where}: 'daemon.{KEY}'"
    if (not isinstance(value, str) or not value or len(value) > MAX_NAME
            or any(c.isspace() or not c.isprintable() or c in "/%" for c in value)):
        raise ConfigError(f"{what} must be a network interface's name, not {value!r}",
                          hint='e.g. cluster_interface = "bridge0" (a Thunderbolt bridge on '
                          'a Mac) or "eth1"; `ip link` or `ifconfig` lists them')
    host = parse_address(agent_addr, port_zero=True).host
    try:
        specific = not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        specific = True  # a host name: its addresses
    if specific:
        raise ConfigError(f"{what} ({value!r}) chooses the address announced for an agent on "
                          f"every interface, but the agent address {agent_addr!r} is one "
                          "address already",
                          hint=f"keep one: agent_addr = \"0.0.0.0:PORT\" with {KEY}, or "
                          f"agent_addr on that interface's address without {KEY}")
    return value
