"""Self-healing on a coordinator: the asyncio shell around ``healing.Healing``.

Every ``TICK_S`` (or the ping interval, if shorter) it looks at the plan the coordinator
serves (``Coordinator.serving``), the failure detector's verdicts and discovery's
candidates, and carries out the decision (``healing.py``). A stage host dead for
``[daemon] heal_after_s`` (``config/healing.py``; 0: off) is healed around:

1. ``heal.started``: the inventories of the hosts alive are polled (only theirs: a dead
   host's poll would take its 10 s), then the same planner as ``mlxctl cluster plan``
   plans the plan's model over them (spares included), in as many stages as before, or
   as many as there are hosts alive if fewer (one host of two left: the whole model on
   it, if it fits; ``healing.stage_count``).
2. It does not fit (``heal.refused``, its message naming each stage's missing memory, and
   a problem in `mlxctl status`): nothing is pushed, the plan stays as it is, and the
   heal is tried again when the hosts alive change.
3. It fits (``heal.planned``): the new plan is pushed as a bring-up
   (``Coordinator.heal``: the same two-phase push, a new epoch, ``bringup.*`` events;
   a surviving host replaces its old stage by the new one, a peer refuses an offer whose
   epoch is not newer than the newest it has seen), then the router serves it and the
   old plan is recorded deactivated, superseded (``heal.active``). A push that does not
   end active is ``heal.failed`` (tried again after ``heal_after_s`` or on a change).
4. A host of the old plan left out of the new one (the dead one) is fenced when it
   answers again: told that its plan is over (``deactivation.tell``), its stale stage
   stops (``heal.fenced``). Were its daemon restarted meanwhile, it asks first and hears
   ``deactivated``. It is then a candidate for the next plan; the running one is left
   as it is. The hosts to fence outlive this daemon: at its start, the hosts of the plans
   that the plan it resumes superseded (``Plans.superseded_by``) are fenced again
   (``ClusterMember._healing``; a host told twice answers ``deactivated`` again).

A drain (`mlxctl drain NODE`) of a host of the served plan is planned around at once,
self-healing on or off (``healing.Replan``), in the same steps and bounds as a heal with
its own events, subject the node: ``drain.replanning`` (the poll and the plan over the
hosts alive and not drained), then ``drain.no_fit`` (naming each stage's missing
memory, a problem in `mlxctl status`; the drain goes on as without a plan, and the
re-plan is tried again when the hosts alive change) or ``drain.replan_pushing`` and
``drain.replanned`` (the new plan serves: the drained host's requests are done, see
below) or ``drain.replan_failed``; the drained host's old stage is then fenced
(``drain.fenced``). From the drain's start (``drain_started``) until that plan is
served or given up, the drain is not said to the router (``holding``: the drain service
asks), so that requests go on being admitted on the old plan: a surviving host's old
stage finishes its sequences as the push replaces it (a stage's SIGTERM drain), and the
router moves to the new plan without a restart (``serve_pipeline(live=True)``, its
``pipeline`` op): its running requests end on the old stages.
With ``--force`` nothing is held: the drain ends its requests at once, then the re-plan
follows. Drained hosts are never planned over (``make_plan``'s ``drained``), by a heal
either; `mlxctl undrain` makes a host a candidate again, not a part of the running plan.

The operator goes first: while a bring-up (`mlxctl cluster activate`, ``pp_auto``, a
resume) or a deactivation runs, nothing is healed; after a deactivation there is no
plan to heal. A heal is a bring-up: `mlxctl cluster activate` during one is refused
(``BringUpInProgress``), and `mlxctl cluster deactivate` is too until the heal's push
is decided, then it ends the push and takes over, as for any bring-up.

A 2D mesh (``--mesh``: stages that are tensor groups) is healed, and re-planned around a
drain, as a mesh of the hosts left (``--mesh auto`` over as many hosts as it had, or
fewer: the least predicted time, or a pipeline when speed cannot be weighed); its groups'
stages are stopped before the new plan's load (``stagehost.py``: no make before break);
the router holds the requests of that break and replays them on the new plan
(``replay.py``: a stage draining, a group broken, a stage gone alike).

Replica groups (`mlxctl cluster activate --replicas R`, R > 1) are healed and re-planned
around a drain in the same steps, a group at a time (``make_group_plan``,
``plan/groups.py``): a group whose hosts are all alive and not drained is kept on its
hosts; a group that lost one is re-planned over the spares (and its own survivors), or,
when none fits, dropped: the new plan has one group fewer (one left: a plain pipeline),
and ``heal.planned`` / ``drain.replan_pushing`` name the hosts. Each host of the new plan
loads its new stage beside the old one, and the router's pool moves live
(``workers/pipeline_router.py``: each group's engine switched, a dropped group retired from
the pool once its sequences end), so the groups kept serve throughout; the old plan's
hosts are told as for a pipeline (``_retire``). A kept group that does not fit beside its
running stages refuses the whole plan (``heal.refused``, ``drain.no_fit``).

Bounds: a look is dict reads; the poll at most 10 s (``DiscoveryService.refresh``); the
push as any bring-up's (``coordinator_round.PUSH_S``, then ``ACTIVATE_FOR_S``); a fence
``deactivation.CONNECT_S`` + ``ANSWER_S``, tried again while the host is alive and has
not answered, after a backoff (``healing.FENCE_RETRY_S`` doubled up to
``FENCE_RETRY_MAX_S``: 1, 2, 4, ... 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.cluster import retiring
from mlxceld.cluster.assignment import deactivation
from mlxceld.cluster.coordinator import Coordinator, Served
from mlxceld.cluster.healing import (
    Decision,
    Heal,
    Healing,
    Held,
    Idle,
    Replan,
    View,
    Waiting,
    stage_count,
)
from mlxceld.cluster.plan.candidates import Proposal, drafted, make_group_plan, make_plan
from mlxceld.discovery.service import DiscoveryService
from mlxceld.errors import MlxceldError, PlanRefused
from mlxceld.state import EventLog
from mlxceld.state.liveness import LivenessState
from mlxceld.types import JSON, MeshMode
from mlxceld.wire import Keyring

log = logging.getLogger(__name__)

TICK_S: Final = 1.0  # between two looks, at most

Liveness = Callable[[], Mapping[str, tuple[LivenessState, float]]]
Drained = Callable[[], Mapping[str, str]]  # agent address -> node id, of drained nodes


class Healer:
    def __init__(self, healing: Healing, coordinator: Coordinator, discovery: DiscoveryService,
                 *, liveness: Liveness, candidates: Callable[[], list[str]], events: EventLog,
                 keyring: Keyring, identity: str, cluster: str, tick_s: float = TICK_S,
                 drained: Drained = dict) -> None:
        self._healing = healing
        self._coordinator = coordinator
        self._discovery = discovery
        self._liveness = liveness
        self._candidates = candidates
        self._events = events
        self._keyring = keyring
        self._identity = identity
        self._cluster = cluster
        self._tick = tick_s
        self._drained = drained
        self._holding: set[str] = set()  # node ids: their drain waits for a re-plan
        self._kick = asyncio.Event()  # look now (a drain started)
        self._stop = asyncio.Event()
        self._last: Decision | None = None
        self.state: JSON = {"state": "off" if not healing.enabled else "idle",
                            "summary": "", "heal_after_s": healing.heal_after_s}
        self._fencing: set[str] = set()

    # -- what `mlxctl status` shows -----------------------------------------------------

    def problems(self) -> list[JSON]:
        if self.state["state"] in ("no_fit", "replan_failed"):
            then = ("start another peer (mlxceld --pp-peer) with the memory named and the "
                    "re-plan is tried again" if self.state["state"] == "no_fit" else
                    "the re-plan is tried again when the hosts alive change (mlxctl events "
                    "-f shows why the push failed)")
            return [{"subject": "drain", "since": self.state.get("since"),
                     "message": self.state["summary"],
                     "next": "the drain goes on without a new plan: requests that need the "
                     f"node are refused until `mlxctl undrain`; {then}"}]
        if self.state["state"] not in ("refused", "failed"):
            return []
        return [{"subject": "healing", "since": self.state.get("since"),
                 "message": f"self-healing {self.state['state']}: {self.state['summary']}",
                 "next": "bring the dead host back, or start another peer (mlxceld "
                 "--pp-peer) with the memory named; mlxctl cluster nodes shows the hosts "
                 "alive, mlxctl events -f what healing does"}]

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        self._kick.set()  # the loop waits on it

    # -- drains -------------------------------------------------------------------------

    def drain_started(self, node: str, force: bool) -> None:
        """`mlxctl drain NODE` was recorded: look now; unless ``force``, hold the drain
        from the router while a plan without the node is tried (``holding``)."""
        served = self._coordinator.serving
        if not force and served is not None and any(
                n == node and a in served.peers for a, n in self._drained().items()):
            self._holding.add(node)
        self._kick.set()

    def holding(self) -> frozenset[str]:
        """The drained nodes whose drain is not to be said to the router yet."""
        return frozenset(self._holding)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while not self._stop.is_set():
                try:
                    await self._look(tg)
                except Exception:  # a bug, a full disk: logged; never stops the daemon
                    log.exception("self-healing: a look failed; the next one follows")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._tick):
                        await self._kick.wait()
                self._kick.clear()

    def _view(self) -> View:
        served = self._coordinator.serving
        return View(served.epoch if served else None, served.peers if served else (),
                    self._liveness(), frozenset(self._candidates()),
                    busy=self._coordinator.busy, drained=frozenset(self._drained()))

    async def _look(self, tg: asyncio.TaskGroup) -> None:
        view = self._view()
        for address, epoch in self._healing.to_fence(view, time.time()):
            if address not in self._fencing:
                self._fencing.add(address)
                tg.create_task(self._guarded(f"fencing {address}", self._fence(address, epoch)))
        decision = self._healing.decide(view, time.time())
        self._report(decision)
        names = self._drained()
        # Held are the drains this decision re-plans around; any other goes on without one.
        self._holding &= ({names.get(a, a) for a in decision.drained}
                          if isinstance(decision, Replan) else set())
        if (isinstance(decision, Heal | Replan)
                and (served := self._coordinator.serving) is not None):
            job = (self._heal(decision, served) if isinstance(decision, Heal)
                   else self._replan(decision, served))
            task = tg.create_task(self._guarded(f"a {type(decision).__name__.lower()}", job))
            try:
                await asyncio.wait({task})  # a deactivation may cancel it: not this loop
            finally:  # a drain started meanwhile stays held: the next look re-plans for it
                if isinstance(decision, Replan):
                    self._holding -= {names.get(a, a) for a in decision.drained}
            if task.cancelled():
                self._last = None
                self._set("idle", f"plan {decision.epoch}: the "
                          f"{type(decision).__name__.lower()} was ended by a deactivation",
                          "heal.cancelled", epoch=decision.epoch)

    async def _guarded(self, what: str, job: Coroutine[Any, Any, None]) -> None:
        """``job``; a bug in it is logged and never ends the healer or the daemon."""
        try:
            await job
        except Exception:
            log.exception("self-healing: %s failed", what)

    def _report(self, decision: Decision) -> None:
        """Each change of decision once: the log, an event, ``state``."""
        if decision == self._last:
            return
        self._last = decision
        if isinstance(decision, Waiting):
            message = (f"plan {decision.epoch}: {', '.join(decision.dead)} dead; healed "
                       f"around at {time.strftime('%H:%M:%S', time.localtime(decision.due))}"
                       f" unless it answers first (heal_after_s "
                       f"{self._healing.heal_after_s:g})")
            self._set("waiting", message, "heal.waiting", epoch=decision.epoch,
                      dead=list(decision.dead), due=decision.due)
        elif isinstance(decision, Held):
            log.info("self-healing of plan %d held: %s", decision.epoch, decision.reason)
        elif isinstance(decision, Idle) and self.state["state"] in ("waiting", "refused",
                                                                      "failed"):
            self._set("idle", decision.reason, "heal.cancelled")
        elif isinstance(decision, Idle) and self.state["state"] in ("no_fit", "replan_failed"):
            self._set("idle", decision.reason)  # undrained, or another plan: nothing to say

    def _set(self, state: str, summary: str, kind: str | None = None, **data: object) -> None:
        self.state = {**self.state, "state": state, "summary": summary, "since": time.time()}
        (log.warning if state in ("refused", "failed") else log.info)(
            "self-healing: %s: %s", state, summary)
        if kind is not None:
            self._events.append(kind, "cluster", summary, **data)

    # -- one heal -----------------------------------------------------------------------

    async def _heal(self, heal: Heal, served: Served) -> None:
        dead = ", ".join(heal.dead)
        why = f"healed around {dead} (dead past heal_after_s {self._healing.heal_after_s:g})"
        self._set("planning", f"plan {heal.epoch}: {dead} dead past the grace; planning "
                  f"over the hosts alive: {', '.join(heal.alive) or 'none'}", "heal.started",
                  epoch=heal.epoch, dead=list(heal.dead), alive=list(heal.alive))
        try:
            proposal = await self._propose(heal, served)
        except MlxceldError as exc:  # a PlanRefused names each stage's missing memory
            self._healing.refused(heal, exc.message)
            self._set("refused", f"plan {heal.epoch} not healed: {exc.message}",
                      "heal.refused", epoch=heal.epoch, dead=list(heal.dead),
                      alive=list(heal.alive), shortfalls=list(getattr(exc, "shortfalls", ())))
            return
        stages = proposal.plan.stages
        self._set("pushing", f"plan {heal.epoch}: a new plan of {len(stages)} stage(s) on "
                  + described(proposal, served), "heal.planned",
                  epoch=heal.epoch, peers=[s.node.key for s in stages],
                  replicas=proposal.plan.replicas)
        ok, summary = await self._coordinator.heal(proposal, served, why, live=True)
        new = self._coordinator.serving
        if not ok or new is None or new.epoch == served.epoch:
            self._healing.failed(heal, summary, time.time())
            self._set("failed", f"plan {heal.epoch} not healed: {summary}", "heal.failed",
                      epoch=heal.epoch)
            return
        self._healing.healed(served.epoch, served.peers, new.peers)  # fenced after this job
        self._last = None
        self._set("healed", f"plan {new.epoch} replaces plan {served.epoch}, {why}: "
                  f"{summary}", "heal.active", epoch=new.epoch, old_epoch=served.epoch,
                  peers=list(new.peers), fenced_later=sorted(self._healing.unfenced()))
        await self._retire(served, new, "heal.retired", "cluster")

    async def _propose(self, heal: Heal | Replan, served: Served) -> Proposal:
        if not heal.alive:
            raise PlanRefused("no host is alive to plan over",
                              hint="bring a host back or start another peer")
        candidates = await self._discovery.refresh(set(heal.alive))
        drained = frozenset(self._drained().values())
        kv = self._coordinator.kv_quant()
        if served.replicas > 1:  # the groups that lost a host re-planned, or dropped
            size = len(served.peers) // served.replicas
            groups = [served.peers[i:i + size] for i in range(0, len(served.peers), size)]
            return drafted(await asyncio.to_thread(
                make_group_plan, candidates, Path(served.model), groups,
                cluster=self._cluster, coordinator=self._identity, drained=drained,
                kv_quant=kv), self._coordinator.draft())
        stages = stage_count(len(served.peers), len(candidates))
        # A 2D mesh's hosts alive, as many as it had or fewer: the mesh of least predicted
        # time over them (a pipeline when speed cannot be weighed), plan/mesh.py's auto.
        mesh: MeshMode = "auto" if served.tp_size > 1 else "pp"
        return drafted(await asyncio.to_thread(
            make_plan, candidates, Path(served.model), stages, cluster=self._cluster,
            coordinator=self._identity, drained=drained, kv_quant=kv, mesh=mesh),
            self._coordinator.draft())

    # -- one re-plan around a drained host ----------------------------------------------

    async def _replan(self, replan: Replan, served: Served) -> None:
        names = self._drained()
        nodes = [names.get(a, a) for a in replan.drained]
        subject = ",".join(nodes)
        said = ", ".join(f"{names.get(a, a)} ({a})" for a in replan.drained)
        why = f"re-planned around drained node {', '.join(nodes)}"
        began = time.monotonic()
        self._set("replanning", f"plan {replan.epoch}: node {said} is drained; planning "
                  f"over the hosts alive and not drained: {', '.join(replan.alive) or 'none'}")
        self._events.append("drain.replanning", subject, self.state["summary"],
                            epoch=replan.epoch, drained=list(replan.drained),
                            alive=list(replan.alive))
        try:
            proposal = await self._propose(replan, served)
        except MlxceldError as exc:  # a PlanRefused names each stage's missing memory
            self._healing.refused(replan, exc.message)
            self._holding.difference_update(nodes)
            self._set("no_fit", f"drain of node {', '.join(nodes)}: plan {replan.epoch} "
                      f"cannot be re-planned without it: {exc.message}; the drain goes on "
                      "without a new plan")
            self._events.append("drain.no_fit", subject, self.state["summary"],
                                epoch=replan.epoch, alive=list(replan.alive),
                                shortfalls=list(getattr(exc, "shortfalls", ())))
            return
        stages = proposal.plan.stages
        self._set("pushing", f"plan {replan.epoch}: a new plan without node {said}: "
                  + described(proposal, served))
        self._events.append("drain.replan_pushing", subject, self.state["summary"],
                            epoch=replan.epoch, peers=[s.node.key for s in stages],
                            replicas=proposal.plan.replicas)
        ok, summary = await self._coordinator.heal(proposal, served, why, live=True)
        new = self._coordinator.serving
        if not ok or new is None or new.epoch == served.epoch:
            self._healing.failed(replan, summary, time.time())
            self._holding.difference_update(nodes)
            self._set("replan_failed", f"drain of node {', '.join(nodes)}: plan "
                      f"{replan.epoch} not re-planned: {summary}; the drain goes on "
                      "without a new plan")
            self._events.append("drain.replan_failed", subject, self.state["summary"],
                                epoch=replan.epoch)
            return
        self._healing.healed(served.epoch, served.peers, new.peers)  # fenced after this job
        self._last = None
        took = time.monotonic() - began
        self._set("replanned", f"plan {new.epoch} replaces plan {served.epoch}, {why} in "
                  f"{took:.1f} s: {summary}")
        self._events.append("drain.replanned", subject, self.state["summary"],
                            epoch=new.epoch, old_epoch=served.epoch, peers=list(new.peers),
                            took_s=round(took, 3))
        await self._retire(served, new, "drain.retired", subject)
        self._holding.difference_update(nodes)  # drained once its requests are done

    async def _retire(self, old: Served, new: Served, kind: str, subject: str) -> None:
        """Make before break, its end (``retiring.py``): the hosts of ``old`` that ``new``
        kept are told ``old`` is over once the router's engine of it closed; the hosts
        left out are fenced after this (``healed``)."""
        kept = [p for p in old.peers if p in new.peers]
        done = await retiring.retire(old.epoch, kept, new.epoch,
                                     closed=self._coordinator.old_plan_retired,
                                     keyring=self._keyring, identity=self._identity)
        message = (f"plan {old.epoch}'s engine at the router "
                   f"{'closed' if done.closed else 'was given up on'}; the hosts plan "
                   f"{new.epoch} kept were told plan {old.epoch} is over "
                   f"({done.said() or 'none'})")
        log.info("self-healing: %s", message)
        self._events.append(kind, subject, message, epoch=old.epoch, new_epoch=new.epoch,
                            told=sorted(done.told), closed=done.closed)

    async def _fence(self, address: str, epoch: int) -> None:
        try:
            outcome = (await deactivation.tell(
                epoch, [address], keyring=self._keyring, identity=self._identity,
                reason=f"plan {epoch} was superseded while this host was down"))[address]
            state, reason = outcome
            if state == "deactivated" or state == "refused":
                self._healing.fenced(address)
                node = self._drained().get(address)
                if node is not None:  # re-planned around: its drained stage stops
                    message = (f"plan {epoch}: drained node {node} ({address}) told its "
                               f"plan is over ({state}{': ' + reason if reason else ''}); "
                               "its stage stops")
                    kind, subject = "drain.fenced", node
                else:
                    message = (f"plan {epoch}: {address} is back; told its plan is over "
                               f"({state}{': ' + reason if reason else ''}); a candidate "
                               "for the next plan")
                    kind, subject = "heal.fenced", "cluster"
                log.info("self-healing: %s", message)
                self._events.append(kind, subject, message, peer=address, epoch=epoch,
                                    outcome=state)
            else:
                wait = self._healing.fence_failed(address, time.time())
                log.info("self-healing: %s not fenced yet (%s: %s); tried again in %g s",
                         address, state, reason, wait)
        except Exception:  # a bug: logged by _guarded, and the fence backs off all the same
            self._healing.fence_failed(address, time.time())
            raise
        finally:
            self._fencing.discard(address)


def described(proposal: Proposal, served: Served) -> str:
    """A new plan's stages for a person; over replica groups, what became of each group
    (kept, re-planned, dropped: the planner's notes)."""
    said = ", ".join(f"{s.stage_id} {s.node.key} layers [{s.layers[0]}, {s.layers[1]})"
                     for s in proposal.plan.stages)
    if served.replicas == 1:
        return said
    return (f"{said} ({proposal.plan.replicas} of {served.replicas} replica groups"
            + "".join(f"; {n}" for n in proposal.notes if n.startswith("replica group"))
            + ")")
