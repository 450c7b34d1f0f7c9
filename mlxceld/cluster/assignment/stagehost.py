"""A peer daemon's ``AssignedStage`` (``peer.py``): what a two-phase round does to its stage
worker.

``prepare_stage`` writes the offered cluster TOML to ``<state-dir>/cluster-E.toml``,
places this node in it and starts the stage worker in standby (weights loaded,
not serving), and waits for it to run while its load advances: a big stage
loads for minutes, so the bound is on no progress, not on the total. The
worker's ``loading`` stat (``types.LoadProgress``, asked every
``PROGRESS_EVERY_S``, and noted in the supervisor's snapshot for systemd's
STATUS line) must come within ``LOAD_START_S`` (60 s: starting the worker,
importing mlx, reading the config and the shards' headers) and then read more
bytes at least every ``LOAD_STALL_S`` (60 s; it reports after each layer); a
stage of a model named by its Hugging Face repo id first downloads its shards
(``step`` ``downloading``, ``models/fetch.py``), under the same two bounds, its
bytes fetched counting as progress until the load's own bytes take over;
a worker that fails (``GAVE_UP``) ends the wait at once;
``activate_stage`` switches it to serving over the worker's control socket;
``stop_stage`` removes it. Which workers run follows the daemon's placement,
so the daemon's side is a ``StageSlot``: set the placement, reconcile.

Make before break: a stage that serves when the next plan's offer is prepared here (a
heal, a drain's re-plan, an operator's re-activate) is not stopped first. It goes on
serving as worker ``stage-retiring`` (``RETIRING``; its process, port, control socket and
log file are kept: ``Supervisor.rename``) beside the new stage while that one loads and
until the new plan serves: the router moves to the new stages live and its running
sequences end on the old ones. The plan the new stage served did
not need more memory than the host had free with the old stage loaded (the inventory
the plan was made from counted it as used). The kept stage stops (SIGTERM: the stage's
own drain) when its coordinator says its plan is over (``end_epoch``: the coordinator
tells the hosts it kept once its router's old engine retired), when a later plan is
prepared, or ``RETIRING_MAX_S`` after the new stage activated, said or not (a
coordinator gone for good). When the new plan does not come to serve here (aborted, or
stopped before it activated) the kept stage is ``stage`` again and serves on
(``stop_stage``), so a failed re-plan leaves the old plan whole. A daemon restarted
meanwhile stops a kept stage (it is no worker of its roster). A tensor-parallel stage
(``[serve] tp_size`` on this host: the ``stage`` worker and its ``stage-tp-<r>`` ranks)
is not kept: its ranks are stopped before the next plan's stage loads (break before
make, an event ``stage.replaced`` says so), as a second group beside it would need a
second ring; the router holds the requests of that break (``pipeline/replay.py``).

A 2D mesh's rank past 0 (the offer's node ``stage-K-tp-R``: ``offers.offered_node``) runs
no stage worker of its own: ``prepare_stage`` tells the slot to accept stage K's rank 0
asking it to join (``RankAssignment``: ``daemon/tensor_rank.py`` answers its
``tensor_reserve`` and ``tensor_join`` for those layers, and its ``stage-tp-R`` worker
starts when rank 0 forms the group, within rank 0's prepare); activating it only notes it
active; stopping it stops that worker and refuses rank 0 again.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from mlxceld import __version__
from mlxceld.cluster.assignment.offers import PeerFacts
from mlxceld.cluster.clusterfile.load import load_cluster
from mlxceld.cluster.clusterfile.model import select_node
from mlxceld.cluster.clusterfile.placement import (
    STAGE_TP_GROUP,
    STAGE_WORKER,
    Placement,
    place,
)
from mlxceld.config.stage_ports import StagePorts
from mlxceld.errors import DaemonError, WorkerError
from mlxceld.models.families import model_family
from mlxceld.models.fetch import local_model
from mlxceld.models.identity import layer_count, model_identity, read_model_config
from mlxceld.state import EventLog
from mlxceld.supervisor import channel
from mlxceld.supervisor.ops import Activate, Stats
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import LoadProgress, WorkerState, load_progress

POLL_S: Final = 0.2  # between two looks at the loading stage worker's state
PROGRESS_EVERY_S: Final = 1.0  # between two asks of its loading progress (its stats)
ASK_S: Final = 0.5  # one ask
LOAD_START_S: Final = 60.0  # a load that says nothing for this long from its start has failed
LOAD_STALL_S: Final = 60.0  # a load that reads no more bytes for this long has failed
_STEPS: Final = ("downloading", "loading")  # a loading stage's steps, in their order
# A loading stage in one of these has failed: a restart is due (BACKOFF), or none (FAILED).
GAVE_UP: Final = frozenset({WorkerState.BACKOFF, WorkerState.FAILED})
RETIRING: Final = "stage-retiring"  # a stage the next plan replaces, while that plan comes up
RETIRING_MAX_S: Final = 120.0  # after its successor activated, a kept stage stops by then


class AssignedStage(Protocol):
    """The stage worker a round prepares, activates and stops: what the daemon does for
    a round (``stagehost.LocalStageHost``)."""

    def facts(self, port: int) -> PeerFacts: ...
    async def prepare_stage(self, epoch: int, node_id: str, toml: str) -> None:
        """Start the stage in standby; returns once it runs, or raises MlxceldError."""
    async def activate_stage(self) -> None: ...
    async def stop_stage(self) -> None: ...
    async def end_epoch(self, epoch: int) -> str | None:
        """Plan ``epoch``, superseded here, is over: its stage stops if it still runs."""
    def loading(self) -> LoadProgress | None:
        """How far the stage being prepared has loaded, when it has said (for the
        ``preparing`` heartbeat)."""


@dataclass(frozen=True)
class RankAssignment:
    """A 2D mesh's rank past 0 on this host: stage ``node_id`` (its rank 0's node id, as
    its ``tensor_join`` names it), its ``layers``, this host's ``rank`` of ``size``."""

    node_id: str
    layers: tuple[int, int]
    rank: int
    size: int


def rank_of(path: Path, node_id: str) -> RankAssignment | None:
    """``node_id``'s rank assignment in the cluster TOML ``path``; None for a stage."""
    cfg = load_cluster(path)
    node = select_node(cfg, node_id)
    if not node.is_mesh or not node.rank or node.layers is None:
        return None
    return RankAssignment(cfg.stage_ranks(node.id)[0].id, node.layers, node.rank,
                          cfg.tensor_parallel_size)


class StageSlot(Protocol):
    """The daemon's side: its placement decides which workers it runs."""

    def accept_rank(self, rank: RankAssignment | None) -> None:
        """Answer a mesh stage's rank 0 as ``rank`` (``daemon/tensor_rank.py``), or not."""

    def set_stage(self, placement: Placement | None, *, standby: bool) -> None:
        """Run ``placement``'s stage (in standby: loaded, not serving), or none."""
    def keep_retiring(self, spec: WorkerSpec | None) -> None:
        """Run ``spec`` (the renamed stage a new plan replaces) beside it, or none."""
    def grouped(self) -> bool:
        """Whether the stage is a tensor-parallel group (its ranks here or across hosts)."""
    async def reconcile(self) -> object:
        """Make the running workers match the placement (what it returns is not used)."""


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class LocalStageHost:
    """The ``AssignedStage`` of a daemon: its stage worker under its supervisor."""

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
        self._loading: LoadProgress | None = None  # what the loading stage last said
        self._epoch: int | None = None  # the plan of the stage worker's stage
        self._active = False  # that stage serves (activated)
        self._kept: tuple[int, Placement] | None = None  # RETIRING's plan and placement
        self._kept_timer: asyncio.Task[None] | None = None
        self._rank: RankAssignment | None = None  # a 2D mesh's rank past 0 here

    def facts(self, port: int) -> PeerFacts:
        model = self._model()
        identity, layers, family = None, None, None
        if model is not None:
            local = local_model(model)  # a repo id: fetched at start (models/fetch.py)
            identity = model_identity(local)
            config = read_model_config(local)
            layers, family = layer_count(config), model_family(config)
        host = self._agent_host()
        return PeerFacts(__version__, self._cluster, identity, layers, host,
                         frozenset({port}) if port_is_free(host, port) else frozenset(),
                         self._stage_ports, family)

    async def prepare_stage(self, epoch: int, node_id: str, toml: str) -> None:
        path = self._state_dir / f"cluster-{epoch}.toml"
        path.write_text(toml)
        await self._clear(epoch)
        rank = await asyncio.to_thread(rank_of, path, node_id)
        if self._rank is not None or rank is not None:  # a rank's worker of an older plan
            await self._remove_stage()
        self._slot.accept_rank(rank)
        self._rank = rank
        if rank is not None:  # rank 0 asks us to join as it prepares its stage
            self._placement, self._epoch, self._active = None, epoch, False
            self._slot.set_stage(None, standby=True)
            await self._slot.reconcile()
            self._events.append("stage.rank", STAGE_WORKER, f"rank {rank.rank} of "
                                f"{rank.node_id}'s tensor group (layers {list(rank.layers)})"
                                " accepted: its rank 0 forms the group", epoch=epoch)
            return
        self._placement = await asyncio.to_thread(place, path, node_id, self._model())
        self._epoch, self._active = epoch, False
        self._slot.set_stage(self._placement, standby=True)
        await self._slot.reconcile()
        await self._wait_loaded()

    async def _wait_loaded(self) -> None:
        """Until the stage worker runs, while its load advances (module docstring)."""
        loop = asyncio.get_running_loop()
        started = False  # a new worker reads EXITED until its start is under way
        self._loading = None
        done, moved_at, asked_at = (-1, -1), loop.time(), 0.0
        while True:
            now = self._supervisor.state(STAGE_WORKER)
            if now is None:
                raise DaemonError("stage worker is missing: it was removed as it "
                                  "loaded", hint="see: mlxctl logs stage")
            state, reason = now
            started = started or state is WorkerState.STARTING
            if state is WorkerState.RUNNING:
                self._loading = None
                self._supervisor.note_loading(STAGE_WORKER, None)
                return
            if state in GAVE_UP or (started and state is WorkerState.EXITED):
                raise DaemonError(f"stage worker is {state}: {reason}",
                                  hint="see: mlxctl logs stage")
            if loop.time() - asked_at >= PROGRESS_EVERY_S:
                asked_at = loop.time()
                read = await self._loaded_bytes()
                if read is not None and read > done:
                    done, moved_at = read, loop.time()
            bound = LOAD_START_S if done[0] < 0 else LOAD_STALL_S
            if loop.time() - moved_at > bound:
                where = ("before reading any weight" if done[0] < 0 else
                         f"at {done[1]} bytes" + (" downloaded" if done[0] == 0 else ""))
                raise DaemonError(f"stage worker's load made no progress for {bound:g} s "
                                  f"({where})",
                                  hint="see: mlxctl logs stage (a disk or network mount "
                                  "that stalls?)")
            await asyncio.sleep(POLL_S)

    async def _loaded_bytes(self) -> tuple[int, int] | None:
        """How far the loading stage worker is (its ``loading`` stat): its step (0
        downloading, 1 loading) and its bytes, in the order progress goes; None when it
        does not say (not started yet, or done)."""
        sock = self._supervisor.control_socket(STAGE_WORKER)
        if sock is None:
            return None
        try:
            reply = await channel.call(sock, Stats(), timeout_s=ASK_S)
        except WorkerError:
            return None
        self._loading = load_progress((reply.get("stats") or {}).get("loading"))
        self._supervisor.note_loading(STAGE_WORKER, self._loading)
        if self._loading is None:
            return None
        return (0 if self._loading.get("step") == _STEPS[0] else 1), self._loading["done"]

    def loading(self) -> LoadProgress | None:
        return self._loading

    async def activate_stage(self) -> None:
        if self._rank is not None:  # its worker serves rank 0's group as it runs
            self._active = True
            return
        sock = self._supervisor.control_socket(STAGE_WORKER)
        if sock is None:
            raise DaemonError("no stage worker to activate (it was stopped after prepare)",
                              hint="see: mlxctl events")
        await channel.call(sock, Activate())
        self._slot.set_stage(self._placement, standby=False)
        await self._slot.reconcile()  # a restart comes back active
        self._active = True
        self._events.append("stage.active", STAGE_WORKER, "the assigned stage is active")
        if self._kept is not None and self._kept_timer is None:
            self._kept_timer = asyncio.create_task(self._end_kept_later())

    async def stop_stage(self) -> None:
        """The round's stage stops. A stage kept while it came up (``RETIRING``) serves on
        as ``stage`` when the new one never served; else it stops too."""
        served = self._active
        self._placement, self._active = None, False
        if self._rank is not None:
            self._rank = None
            self._slot.accept_rank(None)
        self._slot.set_stage(None, standby=False)
        await self._remove_stage()
        if served or self._kept is None:
            await self._end_kept()
            return
        epoch, placement = self._kept
        self._drop_kept()
        if RETIRING in self._supervisor.names():
            self._supervisor.rename(RETIRING, STAGE_WORKER)
        self._placement, self._epoch, self._active = placement, epoch, True
        self._slot.set_stage(placement, standby=False)
        await self._slot.reconcile()  # one that died meanwhile starts again, active
        self._events.append("stage.kept", STAGE_WORKER, f"the next plan did not serve here: "
                            f"the stage of plan {epoch} serves on", epoch=epoch)

    async def end_epoch(self, epoch: int) -> str | None:
        """Plan ``epoch`` is over, as its coordinator says: its stage stops if it runs
        here (kept while the next plan came up, or again ``stage``); what stopped."""
        if self._kept is not None and self._kept[0] == epoch:
            await self._end_kept()
            return "its stage, kept serving while the next plan came up, is stopped"
        if self._epoch == epoch and self._active and (
                STAGE_WORKER in self._supervisor.names() or self._rank is not None):
            await self.stop_stage()
            return "the stage is stopped"
        return None

    async def _clear(self, epoch: int) -> None:
        """Before plan ``epoch``'s stage loads: the stage that serves is kept serving
        (``RETIRING``), any other stage worker removed."""
        if STAGE_WORKER not in self._supervisor.names():
            return
        now = self._supervisor.state(STAGE_WORKER)
        if (not self._active or self._epoch is None or self._placement is None
                or now is None or now[0] is not WorkerState.RUNNING):
            await self._remove_stage()
            return
        if self._ranks() or self._slot.grouped():  # a second ring: not built yet
            await self._remove_stage()
            self._events.append("stage.replaced", STAGE_WORKER, f"the stage of plan "
                                f"{self._epoch} is a tensor-parallel group, which is not "
                                f"kept serving while plan {epoch}'s loads (make before "
                                "break is not built for it yet): stopped first",
                                epoch=self._epoch, next_epoch=epoch)
            return
        await self._end_kept()  # one kept from an older plan stops first
        self._slot.keep_retiring(self._supervisor.rename(STAGE_WORKER, RETIRING))
        self._kept = (self._epoch, self._placement)
        self._events.append("stage.retiring", RETIRING, f"the stage of plan {self._epoch} "
                            f"serves on as {RETIRING} while plan {epoch}'s loads",
                            epoch=self._epoch, next_epoch=epoch)

    def _ranks(self) -> list[str]:
        """The workers of a tensor-parallel stage's other ranks (``stage-tp-<r>``)."""
        prefix = STAGE_TP_GROUP + "-"
        return [n for n in self._supervisor.names()
                if n.startswith(prefix) and n.removeprefix(prefix).isdigit()]

    async def _remove_stage(self) -> None:
        """The stage worker removed (its own drain), then its group's other ranks (which
        end on their own once it closed the group)."""
        if STAGE_WORKER in self._supervisor.names():
            await self._supervisor.remove(STAGE_WORKER)
        for name in self._ranks():
            await self._supervisor.remove(name)

    def _drop_kept(self) -> None:
        self._kept = None
        self._slot.keep_retiring(None)
        timer, self._kept_timer = self._kept_timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()

    async def _end_kept(self) -> None:
        if self._kept is None:
            return
        epoch = self._kept[0]
        self._drop_kept()
        if RETIRING in self._supervisor.names():
            await self._supervisor.remove(RETIRING)  # SIGTERM: the stage's own drain
        self._events.append("stage.retired", RETIRING, f"the stage of plan {epoch}, kept "
                            "while the next plan came up, stopped", epoch=epoch)

    async def _end_kept_later(self) -> None:
        await asyncio.sleep(RETIRING_MAX_S)
        await self._end_kept()
