"""A peer daemon's ``StageHost``: what a two-phase round does to its stage worker.

``prepare_stage`` writes the offered cluster TOML to ``<state-dir>/cluster-E.toml``,
places this node in it and starts the stage worker in standby (weights loaded,
not serving), waiting at most ``peer.PREPARE_S`` for it to run;
``activate_stage`` switches it to serving over the worker's control socket;
``stop_stage`` removes it. Which workers run follows the daemon's placement,
so the daemon's side is a ``StageSlot``: set the placement, reconcile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol

from mlxceld import __version__
from mlxceld.cluster.assignment.offers import PeerFacts
from mlxceld.cluster.assignment.peer import PREPARE_S, port_is_free
from mlxceld.cluster.clusterfile.placement import STAGE_WORKER, Placement, place
from mlxceld.config.stage_ports import StagePorts
from mlxceld.errors import DaemonError
from mlxceld.models.families import model_family
from mlxceld.models.identity import layer_count, model_identity, read_model_config
from mlxceld.state import EventLog
from mlxceld.supervisor import channel
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import WorkerState

POLL_S: Final = 0.2  # between two looks at the loading stage worker
# A loading stage in one of these has failed: a restart is due (BACKOFF), or none (FAILED).
GAVE_UP: Final = frozenset({WorkerState.BACKOFF, WorkerState.FAILED})


class StageSlot(Protocol):
    """The daemon's side: its placement decides which workers it runs."""

    def set_stage(self, placement: Placement | None, *, standby: bool) -> None:
        """Run ``placement``'s stage (in standby: loaded, not serving), or none."""
    async def reconcile(self) -> None:
        """Make the running workers match the placement."""


class LocalStageHost:
    """The ``peer.StageHost`` of a daemon: its stage worker under its supervisor."""

    def __init__(self, slot: StageSlot, supervisor: Supervisor, events: EventLog, *,
                 cluster: str, state_dir: Path, model: Callable[[], str | None],
                 agent_host: Callable[[], str], stage_ports: StagePorts | None = None
                 ) -> None:
        self._slot = slot
        self._supervisor = supervisor
        self._events = events
        self._cluster = cluster
        self._state_dir = state_dir
        self._model = model
        self._agent_host = agent_host
        self._stage_ports = stage_ports
        self._placement: Placement | None = None

    def facts(self, port: int) -> PeerFacts:
        model = self._model()
        identity, layers, family = None, None, None
        if model is not None:
            identity = model_identity(Path(model))
            config = read_model_config(Path(model))
            layers, family = layer_count(config), model_family(config)
        host = self._agent_host()
        return PeerFacts(__version__, self._cluster, identity, layers, host,
                         frozenset({port}) if port_is_free(host, port) else frozenset(),
                         self._stage_ports, family)

    async def prepare_stage(self, epoch: int, node_id: str, toml: str) -> None:
        path = self._state_dir / f"cluster-{epoch}.toml"
        path.write_text(toml)
        if STAGE_WORKER in self._supervisor.names():
            await self._supervisor.remove(STAGE_WORKER)
        self._placement = await asyncio.to_thread(place, path, node_id, self._model())
        self._slot.set_stage(self._placement, standby=True)
        await self._slot.reconcile()
        started = False  # a new worker reads EXITED until its start is under way
        try:
            async with asyncio.timeout(PREPARE_S):
                while True:
                    now = self._supervisor.state(STAGE_WORKER)
                    if now is None:
                        raise DaemonError("stage worker is missing: it was removed as it "
                                          "loaded", hint="see: mlxctl logs stage")
                    state, reason = now
                    started = started or state is WorkerState.STARTING
                    if state is WorkerState.RUNNING:
                        return
                    if state in GAVE_UP or (started and state is WorkerState.EXITED):
                        raise DaemonError(f"stage worker is {state}: {reason}",
                                          hint="see: mlxctl logs stage")
                    await asyncio.sleep(POLL_S)
        except TimeoutError:
            raise DaemonError(f"stage worker did not load within {PREPARE_S:g} s",
                              hint="see: mlxctl logs stage") from None

    async def activate_stage(self) -> None:
        sock = self._supervisor.control_socket(STAGE_WORKER)
        if sock is None:
            raise DaemonError("no stage worker to activate (it was stopped after prepare)",
                              hint="see: mlxctl events")
        await channel.call(sock, "activate")
        self._slot.set_stage(self._placement, standby=False)
        await self._slot.reconcile()  # a restart comes back active
        self._events.append("stage.active", STAGE_WORKER, "the assigned stage is active")

    async def stop_stage(self) -> None:
        self._placement = None
        self._slot.set_stage(None, standby=False)
        if STAGE_WORKER in self._supervisor.names():
            await self._supervisor.remove(STAGE_WORKER)
