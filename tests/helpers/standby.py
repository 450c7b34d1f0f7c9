"""A pipeline with a standby coordinator, between real daemons on 127.0.0.x
(``helpers/front.py``): three peers (.2, .3, .4: two stage hosts and a spare), a
coordinator (.1, no stage of its own) that activated a 2-stage plan over them, and a router
(.5, ``--node-role router --pipeline-coordinator ... --standby``, the peers in its
``--cluster-peers``) serving it. Every daemon runs the failure detector with the dead time
``DEAD_S`` (the stage hosts' lease on their coordinator is as long: cluster/lease.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.cluster import agent
from helpers.daemons import DaemonProc, Daemons
from helpers.front import FOLLOW_WAIT_S, pipeline, serves
from helpers.front import front_router as front
from helpers.waiting import wait_for

__all__ = ["DEAD_S", "LIVENESS", "StandbyPipeline", "serves", "standby_pipeline"]

DEAD_S = 3.0  # the failure detector's dead time: the standby's takeover time, the lease
LIVENESS = f"""
[daemon]
peer_ping_interval_s = 0.5
peer_suspect_after_s = 1.5
peer_dead_after_s = {DEAD_S}
"""


@dataclass
class StandbyPipeline:
    peers: list[DaemonProc]
    coord: DaemonProc
    coord_port: int  # the coordinator's router (OpenAI port)
    coord_flags: tuple[str, ...]  # a restart starts it with them
    first: dict[str, Any]  # the coordinator's bring-up of the plan
    router: DaemonProc  # the standby
    url: str  # the standby's router

    @property
    def coord_url(self) -> str:
        return f"http://127.0.0.1:{self.coord_port}"


def standby_pipeline(daemons: Daemons, model: Path, *,
                     via: Callable[[str], str] | None = None, standby_daemon: str = "",
                     mesh: str = "pp") -> StandbyPipeline:
    """The daemons, the plan active, the standby serving it and standing by. ``model``:
    the fixture's llama. ``via``: given the coordinator's agent, the address the standby is
    told is that agent's (a forwarder in front of it); else the coordinator's agent itself.
    ``standby_daemon``: more ``[daemon]`` lines of the standby's config
    (``heal_after_s = 2``). ``mesh``: the plan's (``tp``: one stage, a tensor group over
    two of the three hosts)."""
    p = pipeline(daemons, model.parent, 3, config=LIVENESS, mesh=mesh)
    r = front(daemons, p, "--standby", "--cluster-peers", ",".join(agent(d) for d in p.peers),
              config=LIVENESS + standby_daemon, name="s", via=via)
    wait_for(lambda: serves(r.url, p.model), FOLLOW_WAIT_S, "the standby serving", every=0.5)
    return StandbyPipeline(p.peers, p.coord, p.coord_port, p.coord_flags, p.first,
                           r.router, r.url)
