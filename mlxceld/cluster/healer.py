"""Self-healing on a coordinator: the asyncio shell around ``healing.Healing``.

Every ``TICK_S`` (or the ping interval, if shorter) it looks at the plan the coordinator
serves (``Coordinator.serving``), the failure detector's verdicts and discovery's
candidates, and carries out the decision (``healing.py``). A stage host dead for
``[daemon] heal_after_s`` (``config/healing.py``; 0: off) is healed around:

1. ``heal.started``: the inventories of the hosts alive are polled (only theirs: a dead
   host's poll would take its 10 s), then the same planner as ``mlxctl cluster plan``
   plans the plan's model over them (spares included), in as many stages as before, or
   as many as there are hosts alive if fewer (one host of two left: the whole model on
   it, if it fits).
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
   as it is.

The operator goes first: while a bring-up (`mlxctl cluster activate`, ``pp_auto``, a
resume) or a deactivation runs, nothing is healed; after a deactivation there is no
plan to heal. A heal is a bring-up: `mlxctl cluster activate` during one is refused
(``BringUpInProgress``), and `mlxctl cluster deactivate` is too until the heal's push
is decided, then it ends the push and takes over, as for any bring-up.

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

from mlxceld.cluster.assignment import deactivation
from mlxceld.cluster.coordinator import Coordinator, Served
from mlxceld.cluster.healing import Decision, Heal, Healing, Held, Idle, View, Waiting
from mlxceld.cluster.plan.candidates import Proposal, make_plan
from mlxceld.discovery.service import DiscoveryService
from mlxceld.errors import MlxceldError, PlanRefused
from mlxceld.state import EventLog
from mlxceld.state.liveness import LivenessState
from mlxceld.types import JSON
from mlxceld.wire import Keyring

log = logging.getLogger(__name__)

TICK_S: Final = 1.0  # between two looks, at most

Liveness = Callable[[], Mapping[str, tuple[LivenessState, float]]]


class Healer:
    def __init__(self, healing: Healing, coordinator: Coordinator, discovery: DiscoveryService,
                 *, liveness: Liveness, candidates: Callable[[], list[str]], events: EventLog,
                 keyring: Keyring, identity: str, cluster: str, tick_s: float = TICK_S) -> None:
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
        self._stop = asyncio.Event()
        self._last: Decision | None = None
        self.state: JSON = {"state": "off" if not healing.enabled else "idle",
                            "summary": "", "heal_after_s": healing.heal_after_s}
        self._fencing: set[str] = set()

    # -- what `mlxctl status` shows -----------------------------------------------------

    def problems(self) -> list[JSON]:
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

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while not self._stop.is_set():
                try:
                    await self._look(tg)
                except Exception:  # a bug, a full disk: logged; never stops the daemon
                    log.exception("self-healing: a look failed; the next one follows")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._tick):
                        await self._stop.wait()

    def _view(self) -> View:
        served = self._coordinator.serving
        return View(served.epoch if served else None, served.peers if served else (),
                    self._liveness(), frozenset(self._candidates()),
                    busy=self._coordinator.busy)

    async def _look(self, tg: asyncio.TaskGroup) -> None:
        view = self._view()
        for address, epoch in self._healing.to_fence(view, time.time()):
            if address not in self._fencing:
                self._fencing.add(address)
                tg.create_task(self._guarded(f"fencing {address}", self._fence(address, epoch)))
        decision = self._healing.decide(view, time.time())
        self._report(decision)
        if isinstance(decision, Heal) and (served := self._coordinator.serving) is not None:
            task = tg.create_task(self._guarded("a heal", self._heal(decision, served)))
            await asyncio.wait({task})  # a deactivation may cancel it: not this loop
            if task.cancelled():
                self._last = None
                self._set("idle", f"plan {decision.epoch}: the heal was ended by a "
                          "deactivation", "heal.cancelled", epoch=decision.epoch)

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
                  + ", ".join(f"{s.stage_id} {s.node.key} layers [{s.layers[0]}, "
                              f"{s.layers[1]})" for s in stages), "heal.planned",
                  epoch=heal.epoch, peers=[s.node.key for s in stages])
        ok, summary = await self._coordinator.heal(proposal, served, why)
        new = self._coordinator.serving
        if not ok or new is None or new.epoch == served.epoch:
            self._healing.failed(heal, summary, time.time())
            self._set("failed", f"plan {heal.epoch} not healed: {summary}", "heal.failed",
                      epoch=heal.epoch)
            return
        self._healing.healed(served.epoch, served.peers, new.peers)
        self._last = None
        self._set("healed", f"plan {new.epoch} replaces plan {served.epoch}, {why}: "
                  f"{summary}", "heal.active", epoch=new.epoch, old_epoch=served.epoch,
                  peers=list(new.peers), fenced_later=sorted(self._healing.unfenced()))

    async def _propose(self, heal: Heal, served: Served) -> Proposal:
        if not heal.alive:
            raise PlanRefused("no host is alive to plan over",
                              hint="bring a host back or start another peer")
        candidates = await self._discovery.refresh(set(heal.alive))
        stages = max(1, min(len(served.peers), len(candidates)))
        return await asyncio.to_thread(make_plan, candidates, Path(served.model), stages,
                                       cluster=self._cluster, coordinator=self._identity)

    async def _fence(self, address: str, epoch: int) -> None:
        try:
            outcome = (await deactivation.tell(
                epoch, [address], keyring=self._keyring, identity=self._identity,
                reason=f"plan {epoch} was superseded while this host was down"))[address]
            state, reason = outcome
            if state == "deactivated" or state == "refused":
                self._healing.fenced(address)
                message = (f"plan {epoch}: {address} is back; told its plan is over "
                           f"({state}{': ' + reason if reason else ''}); a candidate for "
                           "the next plan")
                log.info("self-healing: %s", message)
                self._events.append("heal.fenced", "cluster", message, peer=address,
                                    epoch=epoch, outcome=state)
            else:
                wait = self._healing.fence_failed(address, time.time())
                log.info("self-healing: %s not fenced yet (%s: %s); tried again in %g s",
                         address, state, reason, wait)
        except Exception:  # a bug: logged by _guarded, and the fence backs off all the same
            self._healing.fence_failed(address, time.time())
            raise
        finally:
            self._fencing.discard(address)
