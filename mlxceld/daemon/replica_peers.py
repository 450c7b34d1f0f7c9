"""A router's replicas found by discovery: the daemon tells its router worker the peers
its discovery knows.

On a router node with no ``--replicas`` (and no prefill and decode pools:
``config/replicas.py``'s ``discovers``), every ``PUSH_EVERY_S`` the daemon sends its
router worker (control channel op ``replicas``, as the ``drain`` op is pushed: a
restarted worker learns them within ``PUSH_EVERY_S``) every candidate of its discovery
(``discovery/candidates.py``: ``--cluster-peers``, or mDNS) with a node id whose last
poll did not fail (state ``discovered`` or ``reachable``), as ``{"node_id", "agent"}``.
The worker (``workers/replica_router.py``'s ``Discovered``) asks each new one's agent
what it serves and adds those that are hybrid nodes serving its model; a candidate no
longer sent (gone from the table, or unreachable or refused at its last poll: polls
come every ``discovery/poller.py``'s ``POLL_INTERVAL_S``) is retired from its pool.
A worker that is not running, or does not answer within the control channel's
deadline, is told at the next push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

from mlxceld.config.serve import ROUTER
from mlxceld.discovery.candidates import FAILED_STATES, CandidateTable
from mlxceld.supervisor.ops import Replicas
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import JSON

log = logging.getLogger(__name__)

PUSH_EVERY_S: Final = 3.0


def candidates_of(table: CandidateTable) -> list[JSON]:
    """The candidates to send: those with a node id whose last poll did not fail."""
    rows = (table.get(a) for a in table.addresses())
    return [{"node_id": r.node_id, "agent": r.address} for r in rows
            if r is not None and r.node_id and r.state not in FAILED_STATES]


class ReplicaPeers:
    """Pushes ``candidates_of(table)`` to the router worker while ``wanted()`` (this
    daemon is a router finding its replicas by discovery, as configured now)."""

    def __init__(self, table: CandidateTable, supervisor: Supervisor,
                 wanted: Callable[[], bool]) -> None:
        self._table = table
        self._supervisor = supervisor
        self._wanted = wanted
        self._closing = asyncio.Event()

    async def push(self) -> JSON | None:
        if not self._wanted():
            return None
        return await self._supervisor.call_running(
            ROUTER, Replicas(tuple(candidates_of(self._table))))

    async def run(self) -> None:
        """Push every ``PUSH_EVERY_S`` until ``close``."""
        while not self._closing.is_set():
            try:
                await self.push()
            except Exception as exc:  # never ends the daemon: told again at the next push
                log.warning("could not tell the router its replica candidates: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), PUSH_EVERY_S)

    def close(self) -> None:
        self._closing.set()
