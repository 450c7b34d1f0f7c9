"""The daemon's side of its cluster membership (``cluster/member.py``'s ``DaemonSlot``):
the coordinator's, the assignee's and a rotation's way back into this daemon, made of
the parts they use, never the daemon.

Over a pushed plan the serving window runs the router (``serve_pipeline``,
``stop_pipeline``); a prepared or activated stage is the roster's placement and standby
(``set_stage``, then ``reconcile``); a rotation's key ops are the key window's; drained
nodes are left out of plans.

It lives in the daemon room beside ``root.py`` (the composition root, its only user).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.config.daemon import Config
from mlxceld.control.answers import KeyChange
from mlxceld.daemon.draining import drained_nodes
from mlxceld.daemon.keys import KeyWindow
from mlxceld.daemon.roster import Roster
from mlxceld.daemon.serving import ServingWindow
from mlxceld.state import DrainsTable


@dataclass(frozen=True)
class MemberSide:
    roster: Roster
    serving: ServingWindow
    keys: KeyWindow
    drains: DrainsTable
    is_stopping: Callable[[], bool]

    @property
    def config(self) -> Config:
        return self.roster.config

    @property
    def stopping(self) -> bool:
        return self.is_stopping()

    def served_model(self) -> str | None:
        """The model the router serves or would serve (what the inventory reports)."""
        return self.roster.serve.model

    def router_held(self) -> bool:
        return self.roster.router_held()

    def drained_nodes(self) -> frozenset[str]:
        return drained_nodes(self.drains)

    async def serve_pipeline(self, placement: Placement, *, live: bool = False) -> None:
        await self.serving.serve_pipeline(placement, live=live)

    async def stop_pipeline(self) -> None:
        await self.serving.stop_pipeline()

    def set_stage(self, placement: Placement | None, *, standby: bool) -> None:
        self.roster.placement, self.roster.standby = placement, standby

    async def reconcile(self) -> None:
        await self.roster.reconcile()

    async def install_secret(self, secret: bytes, primary: bool, source: str) -> KeyChange:
        return await self.keys.install_secret(secret, primary, source)

    async def use_secret(self, kid: str) -> KeyChange:
        return await self.keys.use_secret(kid)

    async def remove_secret(self, kid: str) -> KeyChange:
        return await self.keys.remove_secret(kid)

    async def streams_under(self, kid: str) -> dict[str, int]:
        return await self.keys.streams_under(kid)
