"""Discovery as one service of the daemon: static peers, mDNS when asked, inventory polls.

It runs while the agent listener runs (it needs the cluster secret and the
agent's bound address): ``run`` puts the configured static peers into the
candidate table, starts the inventory poller and, with ``--cluster-discovery
mdns``, the mDNS announcer and browser; ``close`` ends them (zeroconf says
goodbye for our record on the way out). An mDNS failure is reported in
``describe()`` and the log and leaves static discovery and polling running; so
does an unexpected exception in either part (logged with its traceback).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Coroutine
from typing import Any

from mlxceld.discovery.candidates import Candidate, CandidateTable
from mlxceld.discovery.poller import InventoryPoller
from mlxceld.types import JSON
from mlxceld.wire import Keyring

log = logging.getLogger(__name__)


class DiscoveryService:
    def __init__(self, table: CandidateTable, keyring: Keyring, *, node_id: str, cluster: str,
                 peers: tuple[str, ...], mode: str, agent_address: str,
                 interface: str | None = None) -> None:
        self._table = table
        self._keyring = keyring
        self._node_id = node_id
        self._cluster = cluster
        self._peers = tuple(p for p in peers if p != agent_address)
        self._mode = mode
        self._address = agent_address
        self._poller = InventoryPoller(table, keyring, agent_address)
        self._stop = asyncio.Event()
        self._error: str | None = None
        self._running = False
        self._interface = interface  # [daemon] cluster_interface: the link to announce
        self._mdns: Any = None  # the MdnsDiscovery while it runs

    def describe(self) -> JSON:
        mdns = self._mdns  # its address and error as they are now (an interface comes up)
        return {"mode": self._mode, "running": self._running, "address": self._address,
                "advertised": mdns.advertised if mdns else None,
                "interface": self._interface,
                "error": (mdns.error if mdns and mdns.error else None) or self._error}

    async def refresh(self, only: Collection[str] | None = None) -> list[Candidate]:
        """Poll every candidate (or those of ``only``) now, at most 10 s; the reachable
        ones (of ``only``), for a plan."""
        if only is None:
            await self._poller.poll_all()
            return self._table.reachable()
        await self._poller.poll_all([a for a in self._table.addresses() if a in only])
        return [c for c in self._table.reachable() if c.address in only]

    def close(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        self._table.on_added = self._poller.wake
        self._table.sync_static(self._peers, time.time())
        self._running = True
        log.info("discovery (%s) for cluster %r: %d static peer(s)", self._mode, self._cluster,
                 len(self._peers))
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._guarded("inventory polling", self._poller.run()))]
                if self._mode == "mdns":
                    tasks.append(tg.create_task(self._guarded("mDNS", self._run_mdns())))
                await self._stop.wait()
                for task in tasks:
                    task.cancel()
        finally:
            self._running = False
            self._table.on_added = None

    def repoll(self) -> None:
        """Poll every candidate at once (this node's keyring changed: what each peer now
        accepts and dials with is worth knowing before the next regular poll)."""
        for address in self._table.addresses():
            self._poller.wake(address)

    async def _guarded(self, what: str, job: Coroutine[Any, Any, None]) -> None:
        """Run ``job``; a bug in it is logged and reported, and never stops the daemon."""
        try:
            await job
        except Exception as exc:
            self._error = f"{what} stopped: {type(exc).__name__}: {exc}"
            log.exception("discovery: %s stopped", what)

    async def _run_mdns(self) -> None:
        from mlxceld.discovery.mdns import MdnsDiscovery  # imports zeroconf: only when asked
        from mlxceld.net.resolve import ResolveError

        try:
            mdns = MdnsDiscovery(self._table, self._keyring, node_id=self._node_id,
                                 cluster=self._cluster, agent_address=self._address,
                                 interface=self._interface)
        except (ValueError, ResolveError) as exc:  # an agent host name that does not resolve
            self._error = str(exc)
            log.error("discovery: %s", exc)
            return
        self._mdns = mdns
        try:
            await mdns.run()
        finally:
            self._error = mdns.error
