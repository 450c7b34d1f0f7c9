"""The daemon's link-test window: `mlxctl cluster link-test PEER` over ``net/link.py``.

``PEER`` is a node id this daemon knows from its candidates (as `mlxctl cluster nodes`
lists them), which names that candidate's agent address; else an agent address,
``host[:port]`` (a host name, an IPv4 address, or an IPv6 one in brackets; a host alone
takes the agent's default port, 19000, as ``--cluster-peers``' entries elsewhere do). A
node id wins over a host of the same name. Neither is ``UnknownNode``, naming it; a
wildcard is no host to dial.

The test is asked as this daemon's agent (its identity, and its IP as the source), so it
needs the agent listener: without a cluster secret it is refused, as planning is. The
measurement's deadlines are ``net/link.py``'s; the control API's client waits for them
(``control/clients/typed.py``: ``LINK_TEST_TIMEOUT_S``).

It lives in the daemon room beside ``root.py``, which hands it ``LinkParts``: the parts
it uses, never the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxceld.config.peers import DEFAULT_AGENT_PORT, host_alone
from mlxceld.errors import ConfigError, UnknownNode
from mlxceld.net.link import LinkReport, measure
from mlxceld.types import JSON
from mlxceld.wire import SecretStore
from mlxceld.wire.address import canonical_address, parse_address

PEER_HINT = ("name a node id of `mlxctl cluster nodes`, or an agent address host[:port] "
             f"(port {DEFAULT_AGENT_PORT} when left out)")


@dataclass(frozen=True)
class LinkParts:
    """What the window uses: the agent listener's address once bound (None before, or
    without a secret), the candidates' rows (``node_id``, ``address``), the keyring."""

    origin: Callable[[], str | None]
    nodes: Callable[[], list[JSON]]
    keyring: SecretStore


class LinkWindow:
    def __init__(self, parts: LinkParts) -> None:
        self._parts = parts

    async def link_test(self, peer: str, pings: int, size: int) -> LinkReport:
        """``pings`` round trips and ``size`` bytes each way with ``peer``'s agent."""
        origin = self._parts.origin()
        if origin is None:
            raise ConfigError("a link test needs the agent listener, which runs once the "
                              "daemon has a cluster secret",
                              hint="install one: mlxctl secret install FILE --primary")
        address, node_id = self.resolve(peer)
        return await measure(origin, address, keyring=self._parts.keyring, pings=pings,
                             size=size, peer=peer, node_id=node_id)

    def resolve(self, peer: str) -> tuple[str, str | None]:
        """The agent address ``peer`` names, and its node id when a candidate has it."""
        rows = self._parts.nodes()
        named = next((str(r["address"]) for r in rows if r.get("node_id") == peer), None)
        if named is not None:
            return named, peer
        text = f"{peer}:{DEFAULT_AGENT_PORT}" if host_alone(peer) else peer
        try:
            address = canonical_address(text)
        except ValueError as exc:
            raise UnknownNode(f"{peer!r} is neither a node id this daemon knows nor an agent "
                              f"address: {text!r} {exc}", hint=PEER_HINT) from None
        if parse_address(address).is_wildcard:
            raise UnknownNode(f"{peer!r} is a wildcard address, which names no host to dial",
                              hint=PEER_HINT)
        node_id = next((r.get("node_id") for r in rows if r.get("address") == address), None)
        return address, str(node_id) if node_id else None
