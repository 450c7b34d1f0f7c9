"""A pipeline with routers in front of it, between real daemons on 127.0.0.x (the set-up of
tests/integration/test_second_router.py and test_standby_coordinator.py): stage hosts
(``--pp-peer``) from 127.0.0.2 on, a coordinator on .1 that holds no stage (its daemon runs
the router only) with a 2-stage plan activated over them (a third host is a spare), and a
router on .5 (``--node-role router``) that follows its plan (``daemon/following.py``)."""

from __future__ import annotations

import os
import signal
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

FRONT_IP = "127.0.0.5"
FOLLOW_WAIT_S = 120.0  # the router learns the plan (1 s polls) and loads its tokenizer
KILLED_S = 10.0  # a daemon killed with -9 is reaped


@dataclass(frozen=True)
class Pipeline:
    """A coordinator serving an active 2-stage plan over the first two of ``peers``."""

    model: Path
    secret: bytes
    peers: list[DaemonProc]
    coord: DaemonProc
    coord_port: int  # the coordinator's router's OpenAI port
    coord_flags: tuple[str, ...]  # a restart of the coordinator starts it with them
    first: dict[str, Any]  # the coordinator's bring-up once active: the plan's epoch, peers


def pipeline(daemons: Daemons, split_fixture_dir: Path, hosts: int, *,
             config: str = "", mesh: str = "pp") -> Pipeline:
    """``hosts`` stage hosts (2, or 3 with a spare) and their coordinator, plan active;
    ``config``: every daemon's mlxceld.toml; ``mesh``: the plan's (``tp``: one stage, a
    tensor group over two of them)."""
    model = split_fixture_dir / "llama"
    secret = os.urandom(16).hex().encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                   name=f"p{i}", config=config) for i in range(2, 2 + hosts)]
    coord, port, flags = coordinator(daemons, secret, peers, config)
    activate(coord, model, 2, *(("--mesh", mesh) if mesh != "pp" else ()))
    return Pipeline(model, secret, peers, coord, port, flags, coord.status()["bringup"])


@dataclass(frozen=True)
class Front:
    """A router in front of a pipeline: its daemon, OpenAI URL and flags (a restart starts
    it with them)."""

    router: DaemonProc
    url: str
    flags: tuple[str, ...]


def front_router(daemons: Daemons, p: Pipeline, *extra: str, config: str = "",
                 name: str = "r", by_name: str | None = None,
                 via: Callable[[str], str] | None = None) -> Front:
    """A router on ``FRONT_IP`` in front of ``p``'s coordinator, started with ``extra``
    flags and ``config`` (the file's text). The coordinator is named by the
    ``--pipeline-coordinator`` flag, as its agent's address (``via``: given that address,
    the one to name instead: a forwarder in front of it); with ``by_name`` (a host name
    of 127.0.0.1, e.g. ``localhost``), by ``[serve] pipeline_coordinator`` in the config
    file instead, as that name and the agent's port."""
    coord = via(agent(p.coord)) if via else agent(p.coord)
    if by_name is not None:
        named = f"{by_name}:{coord.rsplit(':', 1)[1]}"
        config += f'\n[serve]\npipeline_coordinator = "{named}"\n'
    router = daemons.make(config, name=name)
    port = free_port(FRONT_IP)
    flags = ("--cluster-secret-file", str(secret_file(router.root, p.secret)),
             "--agent-addr", f"{FRONT_IP}:{free_port(FRONT_IP)}", "--node-role", "router",
             *(() if by_name is not None else ("--pipeline-coordinator", coord)),
             *extra, "--model", str(p.model), "--host", FRONT_IP, "--port", str(port))
    router.start(*flags)
    return Front(router, f"http://{FRONT_IP}:{port}", flags)


def serves(url: str, model: Path) -> bool:
    """Whether the router at ``url`` answers a greedy completion as the model does."""
    try:
        return greedy(url, PROMPT, 8, model="llama") == expected(model, PROMPT, 8)
    except Exception:  # the router loading, or not yet attached: not yet
        return False


def host_pids(daemons: Daemons, d: DaemonProc) -> list[int]:
    """``d``'s daemon and its workers (its host's processes), each ended after the test
    too."""
    pids = [d.pid, *(w["pid"] for w in d.status()["workers"] if w["pid"])]
    daemons.pids.update(pids)
    return pids


def kill_host(d: DaemonProc, pids: list[int]) -> None:
    """kill -9 of ``d``'s host: its daemon and its workers (``host_pids``), by pid."""
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert d.proc is not None and d.proc.wait(KILLED_S) == -signal.SIGKILL
