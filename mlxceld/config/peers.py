"""Static discovery: the peer agent addresses of ``--cluster-peers`` ([daemon] cluster_peers).

Each entry is ``host:port`` as the cluster TOML writes addresses
(``mlxceld.wire.address``): an IPv4 address, a hostname, or an IPv6 address
in brackets (``[fd00::12]:19000``), with a port of 1-65535 (where a caller gives a
``default_port``, a host alone takes that port: ``studio.local``, ``[fd00::12]``). Entries are
normalized (canonical IPs, ``::ffff:a.b.c.d`` as the IPv4 address it carries,
lowercase hostnames without a trailing dot, IPv6 back in brackets) and a
duplicate is dropped, keeping the first. No DNS is asked here: a hostname is
resolved when it is dialed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from mlxceld.errors import ConfigError
from mlxceld.wire.address import canonical_address, parse_address

MAX_PEERS: Final = 256
PEERS_HINT: Final = ("write host:port pairs separated by commas, e.g. "
                     "192.168.1.11:19000,[fd00::12]:19000")
DEFAULT_AGENT_PORT: Final = 19000  # an agent address given as a host alone has this port


def parse_peers(value: str | Sequence[str], what: str, *, default_port: int | None = None,
                hint: str = PEERS_HINT) -> tuple[str, ...]:
    """The normalized, de-duplicated peers of a comma-separated string or a list of strings.

    ``what`` names the flag or key in errors, ``hint`` says how to write one. An empty
    string means no peers. ``default_port``: the port of an entry that names a host alone
    (else such an entry is refused).
    """
    entries = value.split(",") if isinstance(value, str) else list(value)
    if isinstance(value, str) and not value.strip():
        entries = []
    peers: list[str] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(f"{what}: {entry!r} is not a string", hint=hint)
        text = entry.strip()
        if not text:
            raise ConfigError(f"{what}: an empty entry in {value!r}", hint=hint)
        if default_port is not None and host_alone(text):
            text = f"{text}:{default_port}"
        try:
            address = canonical_address(text)
        except ValueError as exc:
            raise ConfigError(f"{what}: peer {text!r} {exc}", hint=hint) from None
        if address not in peers:
            peers.append(address)
    if len(peers) > MAX_PEERS:
        raise ConfigError(f"{what}: {len(peers)} peers; at most {MAX_PEERS} are allowed",
                          hint="list the agent addresses of the hosts of one cluster only")
    return tuple(peers)


def agent_peers(value: str | Sequence[str], what: str, *, hint: str,
                entry: str = "") -> tuple[str, ...]:
    """``parse_peers`` of agent addresses to dial: ``DEFAULT_AGENT_PORT`` for a host
    alone, a wildcard refused (``entry``: what an address is called in that error)."""
    peers = parse_peers(value, what, default_port=DEFAULT_AGENT_PORT, hint=hint)
    for address in peers:
        if parse_address(address).is_wildcard:
            raise ConfigError(f"{what}: {entry}{address!r} is a wildcard, which names no "
                              "host to dial", hint=hint)
    return peers


def host_alone(text: str) -> bool:
    """Whether ``text`` names a host without a port: a name or IPv4 address without ':',
    or an IPv6 address in brackets (``[fd00::12]``)."""
    return ":" not in text or (text.startswith("[") and text.endswith("]"))
