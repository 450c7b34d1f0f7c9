"""A pipeline with a standby coordinator, between real daemons on 127.0.0.x: three peers
(.2, .3, .4: two stage hosts and a spare), a coordinator (.1, no stage of its own) that
activated a 2-stage plan over them, and a router (.5, ``--node-role router
--pipeline-coordinator ... --standby``, the peers in its ``--cluster-peers``) serving it.
Every daemon runs the failure detector with the dead time ``DEAD_S`` (the stage hosts' lease
on their coordinator is as long: cluster/lease.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.cluster import activate, agent, coordinator, start
from helpers.daemons import DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import greedy
from helpers.waiting import wait_for

DEAD_S = 3.0  # the failure detector's dead time: the standby's takeover time, the lease
LIVENESS = f"""
[daemon]
peer_ping_interval_s = 0.5
peer_suspect_after_s = 1.5
peer_dead_after_s = {DEAD_S}
"""
FOLLOW_WAIT_S = 120.0  # the router learns the plan (1 s polls) and loads its tokenizer


def serves(url: str, model: Path) -> bool:
    try:
        return greedy(url, PROMPT, 8, model="llama") == expected(model, PROMPT, 8)
    except Exception:  # the router loading, or not yet attached: not yet
        return False


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
                     via: Callable[[str], str] | None = None, standby_daemon: str = ""
                     ) -> StandbyPipeline:
    """The daemons, the plan active, the standby serving it and standing by. ``via``: given
    the coordinator's agent, the address the standby is told is that agent's (a forwarder
    in front of it); else the coordinator's agent itself. ``standby_daemon``: more
    ``[daemon]`` lines of the standby's config (``heal_after_s = 2``)."""
    secret = os.urandom(16).hex().encode()
    peers = [start(daemons, ip, secret, "--pp-peer", "--model", str(model), name=f"p{ip[-1]}",
                   config=LIVENESS) for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
    coord, coord_port, coord_flags = coordinator(daemons, secret, peers, LIVENESS)
    activate(coord, model, 2)
    port = free_port("127.0.0.5")
    router = daemons.make(LIVENESS + standby_daemon, name="s")
    router.start("--cluster-secret-file", str(secret_file(router.root, secret)),
                 "--agent-addr", f"127.0.0.5:{free_port('127.0.0.5')}", "--node-role",
                 "router", "--pipeline-coordinator",
                 via(agent(coord)) if via else agent(coord), "--standby",
                 "--cluster-peers", ",".join(agent(p) for p in peers),
                 "--model", str(model), "--host", "127.0.0.5", "--port", str(port))
    url = f"http://127.0.0.5:{port}"
    wait_for(lambda: serves(url, model), FOLLOW_WAIT_S, "the standby serving", every=0.5)
    return StandbyPipeline(peers, coord, coord_port, coord_flags, coord.status()["bringup"],
                           router, url)
