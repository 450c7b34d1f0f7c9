"""A pipeline stage whose tensor-parallel group spans hosts (``--pp-peer --tp-size N
--tp-peers A1,...``, or a 2D mesh's stage node of a cluster TOML: its placement's
``tp_peers``): the ``stage`` worker is rank 0, ranks 1 .. N-1 run on the rank
hosts ``tp_peers`` names (``--node-role tensor_parallel_rank``, ``daemon/tensor_rank.py``)
as their ``stage-tp-<rank>`` workers over the stage's layers; no ``stage-tp`` worker runs
here.

``StagePeers`` is the stage host's ``StageSlot`` (``cluster/assignment/stagehost.py``):
the roster's, with the group formed per placement. Its ``reconcile`` forms the group
before the roster draws the stage worker (the roster draws none until the ring is
formed, ``daemon/roster.py``): each rank host is asked ``tensor_reserve`` then
``tensor_join`` with the placement's layers and node id (``TensorPeers.form_stage``, the
same exchange as a whole model's, ``wire/tensor_messages.py``), and the ring it answers is
the stage's ``tp_hosts``. So the formation happens within the prepare's wait for the
stage to load: a group that does not form fails the prepare (``DaemonError`` naming the
rank host and why), and the coordinator's round says so. A placement of other layers,
or a stage worker to start anew (a plan prepared after the last one's stage stopped),
forms the group again; no placement clears the ring. A 2D mesh's stage, placed by its
cluster TOML at start (no coordinator's prepare), is formed by this same reconcile at
the keeping loop's first look (within ``WATCH_S`` of the start), and asked again each
second until it forms; until then the roster draws no stage worker.

Kept: every ``WATCH_S`` (1 s) the stage worker's process is read; a new process of the
same placement (the supervisor restarted it: its ring broke, ``engine/ring.py``, or it
died) makes the rank hosts be asked to join again, so their ranks start anew and meet
the restarted stage in the ring (at the same ports: each end keeps its port). A rank
that ends, on SIGKILL or SIGTERM or with its daemon, closes its op link, and rank 0's
watchdog ends the stage within ``LINK_POLL_S`` + ``BROKEN_GRACE_S`` (``engine/
tensor.py``). A rank host's daemon that restarted keeps its end at a new port, so the
restarted stage waits in a ring that cannot form (and a rank started for the new one
would reach it at rank 0's port, the same in both, and be stuck with it until its ring
deadline, 60 s): once the ports are reserved and before any rank joins, a ring that
moved stops the stage worker (``tensor.ring_moved``; SIGKILL after ``GROUP_STOP_S``),
and the roster starts it again over the new ring. A group that did not form (its rank
host not back yet) stops the stage worker alike, and is asked again each second (the
ring it then forms at a new port is said alike: ``tensor.ring_moved``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final

from mlxceld.cluster.clusterfile.placement import STAGE_WORKER, Placement, stage_options
from mlxceld.daemon.roster import Roster
from mlxceld.errors import DaemonError
from mlxceld.state.events import EventLog
from mlxceld.supervisor.groups import GROUP_STOP_S
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import WorkerState

if TYPE_CHECKING:
    from mlxceld.cluster.assignment.stagehost import RankAssignment
    from mlxceld.daemon.tensor_peers import TensorPeers
    from mlxceld.daemon.tensor_rank import RankHost

log = logging.getLogger(__name__)

WATCH_S: Final = 1.0
# A pushed 2D mesh's rank 0 forms its group as it prepares, and its rank hosts take their
# offers meanwhile: their refusals (not prepared yet) are asked again for this long.
RANKS_READY_S: Final = 20.0
Stage = tuple[tuple[int, int], str]  # a placement's layers [start, end) and node id


class StagePeers:
    """The stage host's ``StageSlot``: the roster's, its stage's group formed first."""

    def __init__(self, roster: Roster, supervisor: Supervisor, events: EventLog,
                 peers: TensorPeers, rank: RankHost) -> None:
        self._roster = roster
        self._rank = rank  # this host as a pushed 2D mesh's rank past 0 (accept_rank)
        self._supervisor = supervisor
        self._events = events
        self._peers = peers
        self._lock = asyncio.Lock()
        self._formed: Stage | None = None  # the stage the ring was formed for
        self._pid: int | None = None  # the stage worker's process the ring was joined by
        self._last: tuple[Stage, tuple[str, ...]] | None = None  # the last ring formed

    def across(self) -> bool:
        """Whether this daemon is a stage host whose group spans hosts (``--pp-peer
        --tp-peers``, or a 2D mesh's stage placed by its cluster TOML)."""
        return self._roster.stage_across()

    def accept_rank(self, rank: RankAssignment | None) -> None:
        """A pushed 2D mesh's rank past 0 here (``stagehost.py``): rank 0's joins are
        answered for its layers (``RankHost.assign``), or no longer."""
        self._rank.assign(rank)

    def set_stage(self, placement: Placement | None, *, standby: bool) -> None:
        self._roster.set_stage(placement, standby=standby)
        if (self._roster.config.pp_peer and not self._roster.serve.tp_peers
                and not (placement is not None and placement.tp_peers)):
            self._peers.use_peers(())  # a pushed mesh's group is over: none shown

    def keep_retiring(self, spec: WorkerSpec | None) -> None:
        self._roster.keep_retiring(spec)

    def grouped(self) -> bool:
        return self._roster.grouped()

    async def reconcile(self) -> object:
        """The group formed for the placement (when it spans hosts), then the roster's
        reconcile; ``DaemonError`` when the group did not form."""
        async with self._lock:
            if self.across():
                await self._settle()
            return await self._roster.reconcile()

    def _stage(self) -> Stage | None:
        p = self._roster.placement
        if p is None or p.is_coordinator:
            return None
        o = stage_options(p)
        return o.layers, o.node_id

    async def _settle(self) -> None:
        stage = self._stage()
        if stage is None:
            self._roster.tensor_ring, self._formed = None, None
            return
        if (self._roster.tensor_ring is not None and self._formed == stage
                and STAGE_WORKER in self._supervisor.names()):
            return  # a new stage process (a prepare after a stop) asks the ranks again
        await self._form(stage)

    async def _form(self, stage: Stage, restarted: bool = False) -> bool:
        """The group formed for ``stage`` (``DaemonError`` when it did not). A ring that
        moved from the last one formed for it says so (``_moved``); ``restarted``: the
        stage worker runs over that last ring (the supervisor restarted it), and is then
        stopped before any rank joins, and True returned."""
        was = self._last[1] if self._last is not None and self._last[0] == stage else None
        self._roster.tensor_ring, self._formed, self._pid = None, None, None
        p = self._roster.placement
        if p is not None and p.tp_peers:  # a 2D mesh's stage: its file names its ranks
            self._peers.use_peers(p.tp_peers)
        moved = False

        async def reserved(ring: tuple[str, ...]) -> None:
            nonlocal moved
            if was is not None and ring != was and not moved:
                moved = True
                await self._moved(stage, was, ring, restarted)

        ring = await self._peers.form_stage(*stage, reserved)
        if ring is None and self._roster.config.pp_peer:  # pushed: its ranks prepare too
            loop = asyncio.get_running_loop()
            until = loop.time() + RANKS_READY_S
            while ring is None and loop.time() < until:
                await asyncio.sleep(WATCH_S / 2)
                ring = await self._peers.form_stage(*stage, reserved)
        if ring is None:
            raise DaemonError(f"the tensor-parallel group of stage {stage[1]!r} (layers "
                              f"{stage[0][0]}-{stage[0][1]}) across hosts did not form: "
                              f"{self._peers.why}",
                              hint="start each --tp-peers host with --node-role "
                              "tensor_parallel_rank, the same model and cluster secret; "
                              "see: mlxctl status")
        self._roster.tensor_ring, self._formed, self._last = ring, stage, (stage, ring)
        self._events.append("tensor.formed", STAGE_WORKER, f"the stage's tensor-parallel "
                            f"group of {len(ring)} ranks formed: ring {','.join(ring)}")
        return moved and restarted

    async def _moved(self, stage: Stage, was: tuple[str, ...], now: tuple[str, ...],
                     restarted: bool) -> None:
        """The ring moved from the one the stage last formed (a rank host's daemon
        restarted, and reserved another port). A stage worker the supervisor restarted
        over the old one (``restarted``) waits in a ring that can never form, and a rank
        started for the new ring would reach it at rank 0's port (the same in both) and
        be stuck with it: it is stopped before any rank joins (SIGKILL after
        ``GROUP_STOP_S``: waiting in mlx's join it takes no SIGTERM), and the roster
        starts it again over the new ring."""
        moved = ", ".join(f"rank {r} {a} -> {b}"
                          for r, (a, b) in enumerate(zip(was, now, strict=False)) if a != b)
        why = (f"the tensor-parallel ring of stage {stage[1]!r} moved ({moved}): "
               + ("its stage worker, started over the old ring, is stopped and started "
                  "again over the new one" if restarted else "the stage starts over it"))
        log.info("%s", why)
        self._events.append("tensor.ring_moved", STAGE_WORKER, why, was=list(was),
                            now=list(now))
        if restarted:
            await self._stop_stage(why)

    async def _stop_stage(self, why: str) -> None:
        """The stage worker, whose ring will not form, stopped at once (``_moved``)."""
        if STAGE_WORKER in self._supervisor.names():
            await self._supervisor.remove(STAGE_WORKER, why, within_s=GROUP_STOP_S)

    async def run(self) -> None:
        """Keep the group (module docstring) while the daemon runs (on a ``--pp-peer``
        host always: a pushed 2D mesh may make its stage a group across hosts)."""
        if not self.across() and not self._roster.config.pp_peer:
            return
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self._keep()
            except DaemonError as exc:
                log.warning("stage tensor group: %s", exc.message)
            except Exception:  # never ends the daemon: looked at again in WATCH_S
                log.exception("stage tensor group: keeping it failed")

    async def _keep(self) -> None:
        if not self.across():
            return
        if self._formed is None:
            if self._stage() is not None and self._roster.tensor_ring is None:
                await self.reconcile()  # a formation that failed: asked again
            return
        view = next((v for v in self._supervisor.snapshot() if v.name == STAGE_WORKER), None)
        if view is None or view.pid is None:
            return
        got = self._supervisor.state(STAGE_WORKER)
        if got is None or got[0] not in (WorkerState.STARTING, WorkerState.RUNNING):
            return
        if self._pid is None:
            self._pid = view.pid
            return
        if view.pid == self._pid:
            return
        async with self._lock:  # a new stage process: the ranks join it anew
            stage = self._formed
            if stage is None or stage != self._stage():
                return
            log.info("stage worker restarted (pid %s): the rank hosts join again", view.pid)
            self._events.append("tensor.rejoin", STAGE_WORKER, "the stage worker restarted: "
                                "its tensor-parallel ranks across hosts are asked again")
            stopped = False
            try:
                stopped = await self._form(stage, restarted=True)
            except DaemonError as exc:  # its ring will not form: no stop timeout to wait
                await self._stop_stage(f"its tensor-parallel group did not form again: "
                                       f"{exc.message}")
                raise
            finally:
                await self._roster.reconcile()  # no ring: the stage stops until it forms
            self._pid = None if stopped else view.pid  # the one started anew: its own
