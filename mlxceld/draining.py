"""The daemon's drain window: `mlxctl drain|undrain` and `mlxctl drains` over its
``DrainService`` (``drain/``), wired to what lies above that room.

A command names a node by the cluster TOML's id or a daemon's node id, this node's when
it names none; one this daemon does not know (this node, the nodes its router needs,
the nodes its cluster member knows) is refused, naming those (``drain.known_node``). An
undrain of a node that is drained is never refused. ``router_needs`` is what the drain
service asks: this node, and over a pipeline its stages, by the cluster TOML's stage ids
and, for a plan coordinated here, by its hosts' node ids (``roster.router_needs``). The
service tells the running router (its ``drain`` op), and on a coordinator the cluster
member re-plans around a drained stage host (``ClusterMember.drain_started``), the
drain held from the router meanwhile (``drain_held``).

It lives beside ``daemon.py`` (the composition root, its only user), above ``roster``:
the daemon is its ``DrainingHost``.
"""

from __future__ import annotations

from typing import Protocol

from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.cluster.member import ClusterMember
from mlxceld.config.daemon import Config
from mlxceld.config.serve import ROUTER
from mlxceld.drain import DrainService, known_node
from mlxceld.roster import router_needs
from mlxceld.state import DrainsTable, EventLog
from mlxceld.state.node import Node
from mlxceld.supervisor.ops import Drain
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import JSON


class DrainingHost(Protocol):
    """The daemon's side: its node, placement, config, roster, supervisor and member."""

    @property
    def config(self) -> Config: ...
    @property
    def node(self) -> Node: ...
    @property
    def placement(self) -> Placement | None: ...
    @property
    def supervisor(self) -> Supervisor: ...
    @property
    def member(self) -> ClusterMember: ...
    def specs(self, config: Config) -> list[WorkerSpec]:
        """The workers to run now (``roster.draw_roster``)."""


class Draining:
    def __init__(self, host: DrainingHost, table: DrainsTable, events: EventLog) -> None:
        self._host = host
        self.service = DrainService(table, events, needs=self.router_needs,
                                    call_router=self._call_router,
                                    started=lambda node, force: host.member.drain_started(
                                        node, force),
                                    held=lambda: host.member.drain_held())

    def list(self) -> list[JSON]:
        return self.service.list()

    def drain(self, node: str | None, deadline_s: float | None, force: bool) -> JSON:
        return self.service.drain(self._known_node(node), deadline_s, force)

    def undrain(self, node: str | None) -> JSON:
        target = node or self._local_node()
        if target not in {d["node_id"] for d in self.service.list()}:
            self._known_node(target)
        return self.service.undrain(target)

    def drained_nodes(self) -> frozenset[str]:
        return frozenset(d["node_id"] for d in self.service.list())

    def _local_node(self) -> str:
        host = self._host
        return host.placement.node.id if host.placement is not None else host.node.node_id

    def _known_node(self, node: str | None) -> str:
        host = self._host
        known = {self._local_node(), host.node.node_id, *(self.router_needs() or ())}
        if host.placement is not None:  # over replica groups the router needs none of them
            known |= {n.id for n in host.placement.cluster.stages}
        known |= {n["node_id"] for n in host.member.nodes()["nodes"] if n.get("node_id")}
        return known_node(node or self._local_node(), known)

    def router_needs(self) -> frozenset[str] | None:
        """This node, and over a pipeline its stages: by the cluster TOML's stage ids and,
        for a plan coordinated here, by its hosts' node ids. Over replica groups only this
        node: a drained stage host is not held from the router (``roster.router_needs``)."""
        host = self._host
        needs = router_needs(host.specs(host.config), {host.node.node_id, self._local_node()})
        if needs is None or host.placement is None or host.placement.cluster.replicas > 1:
            return needs
        return needs | host.member.plan_node_ids()

    async def _call_router(self, args: JSON) -> JSON | None:
        return await self._host.supervisor.call_running(ROUTER, Drain(tuple(args["drains"])))
