"""Static discovery: the peer agent addresses of ``--cluster-peers`` ([daemon] cluster_peers).

Each entry is ``host:port`` as the cluster TOML writes addresses
(``mlxceld.wire.address``): an IPv4 address, a hostname, or an IPv6 address
in brackets (``[fd00::12]:19000``), with a port of 1-65535. Entries are
normalized (canonical IPs, ``::ffff:a.b.c.d`` as the IPv4 address it carries,
lowercase hostnames without a trailing dot, IPv6 back in brackets) and a
duplicate is dropped, keeping the first. No DNS is asked here: a hostname is
resolved when it is dialed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from mlxceld.errors import ConfigError
from mlxceld.wire.address import canonical_address

MAX_PEERS: Final = 256
PEERS_HINT: Final = ("write host:port pairs separated by commas, e.g. "
                     "192.168.1.11:19000,[fd00::12]:19000")


def parse_peers(value: str | Sequence[str], what: str) -> tuple[str, ...]:
    """The normalized, de-duplicated peers of a comma-separated string or a list of strings.

    ``what`` names the flag or key in errors. An empty string means no peers.
    """
    entries = value.split(",") if isinstance(value, str) else list(value)
    if isinstance(value, str) and not value.strip():
        entries = []
    peers: list[str] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(f"{what}: {entry!r} is not a string", hint=PEERS_HINT)
        text = entry.strip()
        if not text:
            raise ConfigError(f"{what}: an empty entry in {value!r}", hint=PEERS_HINT)
        try:
            address = canonical_address(text)
        except ValueError as exc:
            raise ConfigError(f"{what}: peer {text!r} {exc}", hint=PEERS_HINT) from None
        if address not in peers:
            peers.append(address)
    if len(peers) > MAX_PEERS:
        raise ConfigError(f"{what}: {len(peers)} peers; at most {MAX_PEERS} are allowed",
                          hint="list the agent addresses of the hosts of one cluster only")
    return tuple(peers)
