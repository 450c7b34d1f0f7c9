"""The daemon's drain window: `mlxctl drain|undrain` and `mlxctl drains` over its
``DrainService`` (``drain/``), wired to what lies above that room.

A command names a node by the cluster TOML's id or a daemon's node id, this node's when
it names none; one this daemon does not know (this node, the nodes its router needs,
the nodes its cluster member knows) is refused, naming those (``drain.known_node``); so
is, on a stage host, a drain of its own node (``drain.refuse_stage_host``: its
coordinator sends it the work and re-plans around it; the error names it). An
undrain of a node that is drained is never refused. ``router_needs`` is what the drain
service asks: this node, and over a pipeline its stages, by the cluster TOML's stage ids
and, for a plan coordinated here, by its hosts' node ids (``roster.router_needs``). The
service tells the running router (its ``drain`` op), and on a coordinator the cluster
member re-plans around a drained stage host (``ClusterMember.drain_started``), the
drain held from the router meanwhile (``drain_held``).

It lives in the daemon room beside ``root.py`` (the composition root, its only user),
which hands it ``DrainParts``: the parts it uses, never the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxceld.cluster.member import ClusterMember
from mlxceld.config.serve import ROUTER
from mlxceld.control.answers import DrainView, Undrained
from mlxceld.daemon.roster import Roster, router_needs
from mlxceld.drain import DrainService, known_node, refuse_stage_host
from mlxceld.state import DrainRow, DrainsTable, EventLog
from mlxceld.supervisor.ops import Drain
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import JSON


@dataclass(frozen=True)
class DrainParts:
    """What the drain window uses, never the daemon: the roster (the placement, the
    router's spec), this daemon's node id, the supervisor (the router's ``drain`` op) and
    the cluster member (the nodes it knows, a drained stage host re-planned around)."""

    roster: Roster
    node_id: str
    supervisor: Supervisor
    member: ClusterMember


class DrainWindow:
    def __init__(self, parts: DrainParts, table: DrainsTable, events: EventLog) -> None:
        self._parts = parts
        member = parts.member
        self.service = DrainService(table, events, needs=self.router_needs,
                                    call_router=self._call_router,
                                    started=member.drain_started, held=member.drain_held)

    def list(self) -> list[DrainView]:
        return self.service.list()

    def drain(self, node: str | None, deadline_s: float | None, force: bool) -> DrainRow:
        target = self._known_node(node)
        placement = self._parts.roster.placement
        if placement is not None and not placement.is_coordinator:  # a stage host
            coordinator = placement.cluster.coordinator
            refuse_stage_host(target, {self._local_node(), self._parts.node_id},
                              placement.node.id, (coordinator.id, coordinator.address))
        return self.service.drain(target, deadline_s, force)

    def undrain(self, node: str | None) -> Undrained:
        target = node or self._local_node()
        if target not in {d.row.node_id for d in self.service.list()}:
            self._known_node(target)
        return self.service.undrain(target)

    def _local_node(self) -> str:
        placement = self._parts.roster.placement
        return placement.node.id if placement is not None else self._parts.node_id

    def _known_node(self, node: str | None) -> str:
        parts, placement = self._parts, self._parts.roster.placement
        known = {self._local_node(), parts.node_id, *(self.router_needs() or ())}
        if placement is not None:  # over replica groups the router needs none of them
            known |= {n.id for n in placement.cluster.stages}
        known |= {n["node_id"] for n in parts.member.nodes().nodes if n.get("node_id")}
        return known_node(node or self._local_node(), known)

    def router_needs(self) -> frozenset[str] | None:
        """This node, and over a pipeline its stages: by the cluster TOML's stage ids and,
        for a plan coordinated here, by its hosts' node ids. Over replica groups only this
        node: a drained stage host is not held from the router (``roster.router_needs``)."""
        parts, placement = self._parts, self._parts.roster.placement
        needs = router_needs(parts.roster.specs(), {parts.node_id, self._local_node()})
        if needs is None or placement is None or placement.cluster.replicas > 1:
            return needs
        return needs | parts.member.plan_node_ids()

    async def _call_router(self, args: JSON) -> JSON | None:
        return await self._parts.supervisor.call_running(ROUTER, Drain(tuple(args["drains"])))


def drained_nodes(table: DrainsTable) -> frozenset[str]:
    """The node ids `mlxctl drain` holds drained or draining (left out of plans)."""
    return frozenset(row.node_id for row in table.all())
