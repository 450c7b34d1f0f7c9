"""The candidate table: peers discovery proposed, and what polling their inventory found.

A candidate is keyed by its agent address (normalized ``host:port``) and comes
from a ``source``: ``static`` (``--cluster-peers``) or ``mdns`` (a signed record
that passed every check of ``records.py``). Its ``state``::

    discovered ──inventory answered──────────▶ reachable
         │                                        ▲  │
         ├──dial, handshake time-out or bad answer─┼─▶ unreachable
         └──handshake refused (secret, key id,     │
            version, identity)────────────────────┴─▶ refused

Each poll sets the state anew, so any of reachable, unreachable and refused can
follow any state. Discovery only proposes: a candidate is a peer only as far as
the authenticated handshake of its last poll says (reachable).

Rules, each applied where the table changes:

- A static peer is added once as ``discovered``; ``sync_static`` at start drops
  static rows that are no longer configured (mdns rows stay until they expire).
- An mDNS record updates its node's row only if its ``ts`` is not older than the
  newest one seen (``record_ts``); a node seen at a new address replaces its
  row at the old one. A static row keeps ``source = static`` when mDNS finds it too.
- ``expire(now)`` drops each mdns row whose newest valid record's ``ts`` is more
  than ``FRESHNESS_S`` (60 s) from ``now`` (PROTOCOL.md section 5).
- An answer whose node id is our own means the address is this daemon: the
  row is removed (a shared peer list may name every host, this one included).

The table is in memory and written through to the ``peers`` SQLite table, so
``mlxctl cluster nodes`` shows the last known state after a daemon restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from mlxceld.state.peers import PeerRow, PeersTable, PeerState
from mlxceld.types import JSON
from mlxceld.wire.beacon import FRESHNESS_S

log = logging.getLogger(__name__)

Candidate = PeerRow
FAILED_STATES: tuple[PeerState, ...] = ("unreachable", "refused")


class CandidateTable:
    def __init__(self, store: PeersTable | None = None, *, node_id: str = "") -> None:
        self._store = store
        self._node_id = node_id  # our own: never a candidate
        self._rows: dict[str, Candidate] = {r.address: r for r in store.all()} if store else {}
        self.on_added: Callable[[str], None] | None = None  # the poller's wake-up

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, address: str) -> Candidate | None:
        return self._rows.get(address)

    def addresses(self) -> list[str]:
        return sorted(self._rows)

    def reachable(self) -> list[Candidate]:
        """The candidates whose last poll authenticated and answered, by address."""
        return [self._rows[a] for a in sorted(self._rows) if self._rows[a].state == "reachable"]

    def snapshot(self) -> list[JSON]:
        return [self._rows[a].to_json() for a in sorted(self._rows)]

    # -- proposals ----------------------------------------------------------------------

    def sync_static(self, peers: Iterable[str], now: float) -> None:
        """Make the static rows the configured ``peers``: add the new, drop the gone."""
        wanted = list(peers)
        for address in [a for a, r in self._rows.items()
                        if r.source == "static" and a not in wanted]:
            self._remove(address, "no longer in --cluster-peers")
        for address in wanted:
            self.propose_static(address, now)

    def propose_static(self, address: str, now: float) -> None:
        if address not in self._rows:
            self._add(Candidate(address, "static", "discovered", now))

    def propose_record(self, record: Mapping[str, str], address: str, now: float) -> None:
        """A verified mDNS ``record`` of a node whose agent is at ``address``."""
        node, ts = record["node"], int(record["ts"])
        if node == self._node_id:
            return
        for other in [a for a, r in self._rows.items()
                      if r.source == "mdns" and r.node_id == node and a != address]:
            if (self._rows[other].record_ts or 0) > ts:
                return  # an older record than the one that put the node elsewhere
            self._remove(other, f"node {node} now announces {address}")
        row = self._rows.get(address)
        if row is not None and row.record_ts is not None and row.record_ts > ts:
            return
        fields: dict[str, Any] = {"node_id": node, "version": record["ver"],
                                  "key_id": record["kid"], "record_ts": ts, "last_seen": now,
                                  "updated_at": now}
        if row is None:
            self._add(Candidate(address, "mdns", "discovered", **fields))
        else:
            self._put(replace(row, **fields))

    # -- poll results -------------------------------------------------------------------

    def answered(self, address: str, inventory: JSON, key_id: str, now: float) -> None:
        """The peer at ``address`` answered its inventory over an authenticated stream
        (``key_id``: the stream's; the inventory's own, its primary, wins)."""
        row = self._rows.get(address)
        if row is None:
            return
        if inventory["node"] == self._node_id:
            self._remove(address, "it is this daemon")
            return
        if row.state != "reachable":
            log.info("peer %s (%s) is reachable", address, inventory["node"])
        self._put(replace(row, state="reachable", node_id=inventory["node"],
                          version=inventory["version"],
                          key_id=inventory.get("key_id") or key_id,
                          memory_total=inventory["memory_total"],
                          memory_available=inventory["memory_available"], error=None,
                          last_seen=now, inventory=inventory, updated_at=now))

    def failed(self, address: str, state: PeerState, error: str, now: float) -> None:
        """A poll of ``address`` failed: ``state`` is unreachable or refused."""
        assert state in FAILED_STATES
        row = self._rows.get(address)
        if row is None:
            return
        if (row.state, row.error) != (state, error):
            log.warning("peer %s is %s: %s", address, state, error)
        self._put(replace(row, state=state, error=error, updated_at=now))

    def expire(self, now: float) -> list[str]:
        """Drop mdns candidates whose newest valid record is stale; their addresses."""
        stale = [a for a, r in self._rows.items() if r.source == "mdns"
                 and (r.record_ts is None or abs(now - r.record_ts) > FRESHNESS_S)]
        for address in stale:
            self._remove(address, f"its newest mDNS record is more than {FRESHNESS_S} s old")
        return stale

    # -- storage ------------------------------------------------------------------------

    def _add(self, row: Candidate) -> None:
        log.info("candidate peer %s (%s)%s", row.address, row.source,
                 f", node {row.node_id}" if row.node_id else "")
        self._put(row)
        if self.on_added is not None:
            self.on_added(row.address)

    def _put(self, row: Candidate) -> None:
        self._rows[row.address] = row
        if self._store is not None:
            self._store.put(row)

    def _remove(self, address: str, why: str) -> None:
        log.info("candidate peer %s dropped: %s", address, why)
        del self._rows[address]
        if self._store is not None:
            self._store.delete(address)
