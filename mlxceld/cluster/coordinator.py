"""The coordinator's bring-up: plan over the reachable peers, push the plan, serve it.

``--pp-auto N`` (``bring_up``), ``--pp-auto N --dry-run`` (``dry_run``),
``mlxctl cluster plan`` (``plan``), ``mlxctl cluster activate`` (``activate``)
and ``mlxctl cluster deactivate`` (``deactivate``, ``deactivation.py``) run here.
Drained nodes (`mlxctl drain`) are left out of every plan, and its notes say so. A model
of a family mlxceld does not split is refused by each of them before any peer is asked or
waited for (``models.families.require_splittable``: ``UnsupportedFamily``).

At the daemon's start (``start``) the newest plan that took over is resumed when it
was committed or active (``Plans.resumable``: a newer plan that was aborted or never
decided, such as a heal's push that failed, is passed over), whatever the flags and
the config file say now, so that a coordinator run by a service manager serves its
plan again after a restart without planning again or reloading the peers' weights: a
plan decided ``active`` is served as it is, one decided ``commit`` or ``activate`` is pushed
on until every peer is active (``assignment.resume_push``). A plan that was
deactivated is not resumed. Only without a plan to resume does ``pp_auto``
plan and push a new one. When the config now names another model, ``pp_auto`` another
number of stages, or ``--mesh`` another than the plan was planned with (a heal's keeps
its plan's), the plan is still resumed as it was (the running cluster wins over a changed
start-up setting: a restart never reloads weights nor ends requests by itself), and the
difference is logged, recorded as the event ``bringup.config_differs`` and shown by
`mlxctl status` (``config_differs``): `mlxctl cluster activate` re-plans now.

The daemon hands over what a bring-up needs (its plans table, keyring,
discovery, agent address, event log) and a ``CoordinatorSlot``: its window for
running the router over a pushed plan, and for stopping it.

One bring-up at a time: while one plans or pushes, ``activate`` raises
``BringUpInProgress`` naming its plan. ``deactivate`` does too while a plan is
undecided, but not once it is decided commit or activate: then the push only
re-sends the decision (for up to ``ACTIVATE_FOR_S`` to a lost peer), and a
deactivation ends it at once (``_end_decided_push``) and takes over, so that a
peer gone for good never locks the operator out. ``state`` is what ``mlxctl status``
shows as ``bringup``, and what ``mlxctl cluster activate`` polls: its shape, each
peer's states and the ``bringup.*`` events are ``BringUp``'s (``bringup.py``).

A push decided activate that ends without every peer active (one unreachable
for ``coordinator_round.ACTIVATE_FOR_S``, or one that aborted on its own) is
``failed`` with a summary that says the decision stands; the plan stays
``activate`` in the plans table, so this daemon's restart resumes it, and so
does the first ``query`` of a peer that comes back (``peer_asked``).

Bounds: ``DRY_RUN_WAIT_S`` and ``PP_AUTO_WAIT_S`` for enough reachable peers
(each poll of every candidate takes at most 10 s, ``DiscoveryService.refresh``);
the push itself is bounded by ``coordinator_round.PUSH_S`` (``push.push``) up to
the activate decision, then by ``coordinator_round.ACTIVATE_FOR_S`` (``push.ACTIVATING_S``:
tests shorten it, ``MLXCELD_TEST_ACTIVATE_FOR_S``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from mlxceld.cluster import retiring
from mlxceld.cluster.assignment import deactivation
from mlxceld.cluster.assignment.push import push, push_plan, resume_push
from mlxceld.cluster.bringup import (
    BringUp,
    config_differences,
    resumed_model,
    resumed_rows,
)
from mlxceld.cluster.clusterfile.placement import Placement, place
from mlxceld.cluster.plan.candidates import Proposal, drafted, make_plan, model_dir
from mlxceld.discovery.service import DiscoveryService
from mlxceld.errors import BringUpInProgress, MlxceldError, NoActivePlan
from mlxceld.models.families import require_splittable
from mlxceld.models.identity import read_model_config
from mlxceld.models.kvquant import check_kv_quant
from mlxceld.pipeline.switch import RETIRE_S
from mlxceld.roles.options import KVQuant
from mlxceld.state import EventLog
from mlxceld.state.plans import RESUMABLE as PLAN_RESUMABLE
from mlxceld.state.plans import PlanRow, Plans, superseded
from mlxceld.types import DEFAULT_MESH, JSON, MeshMode
from mlxceld.wire import Keyring

log = logging.getLogger(__name__)

DRY_RUN_WAIT_S: Final = 30.0  # --pp-auto --dry-run waits this long for enough reachable peers
PP_AUTO_WAIT_S: Final = 60.0  # --pp-auto (assigning) waits this long for enough reachable peers
POLL_S: Final = 1.0  # between two polls of the candidates while waiting for peers
# A live move's old engine closes within RETIRE_S; past this the old plan is over anyway.
RETIRED_WAIT_S: Final = RETIRE_S + 5.0
RESUMABLE: Final = PLAN_RESUMABLE  # a plan decided so is resumed at start (Plans.resumable)


@dataclass(frozen=True)
class Served:
    """The plan this coordinator serves: its epoch, model directory and stage hosts."""

    epoch: int
    model: str
    peers: tuple[str, ...]  # agent addresses, in rank order (group by group)
    replicas: int = 1  # replica groups, ``peers`` group by group (healer.py re-plans each)
    tp_size: int = 1  # a 2D mesh's stages' groups (``peers``: every rank's host)


class CoordinatorSlot(Protocol):
    """The daemon's side: run the router over a pushed plan."""

    async def serve_pipeline(self, placement: Placement, *, live: bool = False) -> None:
        """Adopt ``placement`` (this daemon as its coordinator) and (re)start the router;
        ``live``: move a running router to its stages without a restart, if it can."""

    async def stop_pipeline(self) -> None:
        """Drop the placement and stop the router; serve nothing until told again."""

    async def old_plan_retired(self, within_s: float) -> bool:
        """Whether the router, moved live, closed the old plan's engine within it."""


class Coordinator:
    def __init__(self, slot: CoordinatorSlot, tasks: asyncio.TaskGroup, *, cluster: str,
                 state_dir: Path, config_out: Path | None, plans: Plans, keyring: Keyring,
                 discovery: DiscoveryService, identity: str, events: EventLog,
                 drained: Callable[[], frozenset[str]] = frozenset,
                 kv_quant: Callable[[], KVQuant | None] = lambda: None,
                 draft: Callable[[], tuple[str | None, int]] = lambda: (None, 4)) -> None:
        """``kv_quant``: the router's ``[serve] kv_bits`` now (a reload may change it):
        plans price the KV cache at its width, and a family that cannot keep it is
        refused before any peer is asked; ``draft``: its ``[serve] draft_model`` and k,
        which each plan's TOML carries to its last stages (``candidates.drafted``)."""
        self._slot = slot
        self._tasks = tasks  # the daemon's: a bring-up runs there
        self._cluster = cluster
        self._state_dir = state_dir
        self._config_out = config_out
        self._plans, self._keyring = plans, keyring
        self._discovery = discovery
        self._identity = identity  # our agent address: the peers bind our identity to it
        self._events = events
        self._drained = drained  # node ids `mlxctl drain` left out of every plan
        self.kv_quant, self.draft = kv_quant, draft
        self._bringup = BringUp(events)  # the last bring-up, for `mlxctl status`
        self._busy = False  # a bring-up plans or pushes, or a deactivation runs
        self._task: asyncio.Task[None] | None = None
        self._chase: asyncio.Task[None] | None = None  # peers not told of a deactivation
        self.serving: Served | None = None  # the plan the router serves, once it does

    @property
    def state(self) -> JSON | None:
        """The last bring-up, for `mlxctl status` (``BringUp.state``)."""
        return self._bringup.state

    @state.setter
    def state(self, state: JSON | None) -> None:
        self._bringup.state = state

    def checking(self, epoch: int) -> None:
        """At the daemon's start, before plan ``epoch`` is resumed: its peers are asked
        whether another coordinator superseded it (``fencing.Fence.start``)."""
        self.state = {"state": "resuming", "epoch": epoch, "summary": f"plan {epoch}: "
                      "asking its peers whether a newer plan serves before resuming it",
                      "peers": []}

    @property
    def busy(self) -> bool:
        """A bring-up (an operator's, a resume, a heal) or a deactivation runs."""
        return self._busy

    async def propose(self, model: str, stages: int, what: str = "mlxctl cluster plan",
                      *, replicas: int = 1, mesh: MeshMode = DEFAULT_MESH) -> Proposal:
        """Poll every candidate now, then plan ``stages`` stages (hosts, as ``mesh`` says)
        of ``model`` (a local directory; ``replicas`` groups of them) over the reachable
        ones that are not drained (the plan's notes say which are)."""
        path = await asyncio.to_thread(model_dir, model, what)  # a repo id: may fetch
        require_splittable(path, what)  # before any peer is asked
        kv = self.kv_quant()
        check_kv_quant(read_model_config(path), kv, source=f"{what}: {path / 'config.json'}")
        candidates = await self._discovery.refresh()
        # In a thread: a repo id's shards this host lacks are priced from the Hub's headers.
        return drafted(await asyncio.to_thread(
            make_plan, candidates, path, stages, cluster=self._cluster,
            coordinator=self._identity, drained=self._drained(), replicas=replicas,
            kv_quant=kv, mesh=mesh), self.draft())

    def start(self, n: int | None, model: str | None, configured_model: str | None,
              mesh: MeshMode = DEFAULT_MESH) -> None:
        """At the daemon's start, in the background: resume the latest plan if it is
        committed or active; else with ``n`` (pp_auto) ``bring_up`` one of ``model`` as
        ``mesh``. ``configured_model``: the model the flags or the config file name."""
        last, resumable = self._plans.latest(), self._plans.resumable()
        if resumable is not None:
            if last is not None and last.epoch != resumable.epoch:
                log.info("plan %d (%s) never took over; plan %d (%s) is resumed", last.epoch,
                         last.decision or "undecided", resumable.epoch, resumable.decision)
            self._claim()
            self._task = self._tasks.create_task(
                self._resume_at_start(resumable, n, configured_model, mesh))
        elif n is not None and model is not None:
            self._task = self._tasks.create_task(self.bring_up(n, model, mesh))
        elif last is not None and last.decision == "deactivated":
            self.state = {"state": "deactivated", "epoch": last.epoch, "stages":
                          len(last.peers), "summary": f"plan {last.epoch} was deactivated "
                          f"({last.summary}); mlxctl cluster activate brings up a new one",
                          "peers": []}

    def peer_asked(self, epoch: int, decision: str) -> None:
        """A peer asked about plan ``epoch`` (``query``) and heard ``activate``: if no push
        runs, the last one ended without that peer active (``Phase.STALLED``: it was
        unreachable for ``ACTIVATE_FOR_S``), and it is back: push the plan on, as a restart
        of this daemon would (``resume_push``)."""
        if decision != "activate" or self._busy:
            return
        last = self._plans.latest()
        if last is None or (last.epoch, last.decision) != (epoch, "activate"):
            return
        log.info("plan %d: a peer asks about it and it is decided activate: pushing on", epoch)
        self._claim()
        self._task = self._tasks.create_task(
            self._resume_at_start(last, None, None, why="a peer asked about it"))

    def close(self) -> None:
        """The daemon stops: a push cut short is presumed aborted; its peers abort by their
        deadline (``peer_round.PEER_PHASE_S``), or at once on asking us after our restart.
        Peers not told of a deactivation learn it when their daemon restarts."""
        for task in (self._task, self._chase):
            if task is not None:
                task.cancel()

    async def activate(self, model: str, stages: int, replicas: int = 1,
                       mesh: MeshMode = DEFAULT_MESH) -> JSON:
        """`mlxctl cluster activate`: plan now (a plan that does not fit is raised here, as
        `mlxctl cluster plan` would), then push it and serve the router over it; with
        ``replicas`` groups, every group's stages in the one push (one plan, one epoch).
        Returns the state at once, with the plan's epoch; poll ``state`` for the rest."""
        self._claim()
        before = self.state
        try:
            path = str(await asyncio.to_thread(model_dir, model, "mlxctl cluster activate"))
            self.state = {"state": "planning", "model": path, "stages": stages * replicas,
                          "summary": ""}
            proposal = await self.propose(path, stages, "mlxctl cluster activate",
                                          replicas=replicas, mesh=mesh)
        except BaseException:  # refused at once (the caller hears why): nothing happened
            self.state, self._busy = before, False
            raise
        epoch = self._plans.next_epoch()
        self._bringup.pushing(epoch, proposal.plan)
        self._task = self._tasks.create_task(self._push_and_serve(epoch, proposal, path))
        return self.state or {}

    def _claim(self) -> None:
        if self._busy:
            epoch = (self.state or {}).get("epoch")
            raise BringUpInProgress(
                f"a bring-up is in progress (plan {epoch})" if epoch else
                "a bring-up is in progress (planning)",
                hint="wait for it to end (mlxctl status shows it), then try again")
        self._busy = True

    async def await_peers(self, n: int, within_s: float) -> None:
        """Poll the candidates until ``n`` are reachable or ``within_s`` has passed."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + within_s
        while len(await self._discovery.refresh()) < n and loop.time() < give_up:
            await asyncio.sleep(POLL_S)

    async def dry_run(self, n: int, model: str, mesh: MeshMode = DEFAULT_MESH) -> str:
        """``--pp-auto N --dry-run``: wait (at most ``DRY_RUN_WAIT_S``) until N peers are
        reachable, plan, write ``--cluster-config-out``; return the report for the terminal
        (the table, its notes, where the TOML went). A plan that does not fit is raised."""
        path = await asyncio.to_thread(model_dir, model, "--model")
        require_splittable(path, "--model")  # before waiting
        await self.await_peers(n, DRY_RUN_WAIT_S)
        proposal = await self.propose(model, n, mesh=mesh)
        report = [proposal.table, *(f"note: {note}" for note in proposal.notes)]
        if self._config_out is not None:
            self._config_out.write_text(proposal.toml)
            report.append(f"cluster TOML written to {self._config_out}")
        return "\n".join(report)

    async def bring_up(self, n: int, model: str, mesh: MeshMode = DEFAULT_MESH) -> None:
        """``--pp-auto N``: wait (at most ``PP_AUTO_WAIT_S``) for N reachable peers, plan
        (as ``mesh``), push the plan (two-phase), then run the router over the pipeline. A
        failure is logged and recorded; the daemon stays up, idle."""
        self._claim()
        try:
            self.state = {"state": "planning", "model": model, "stages": n, "summary": ""}
            try:
                path = await asyncio.to_thread(model_dir, model, "--model")
                require_splittable(path, "--model")  # before waiting
                await self.await_peers(n, PP_AUTO_WAIT_S)
                proposal = await self.propose(model, n, mesh=mesh)
            except MlxceldError as exc:  # a PlanRefused names the candidates left out
                self._bringup.failed(f"no plan: {exc.message}")
                return
            epoch = self._plans.next_epoch()
            self._bringup.pushing(epoch, proposal.plan)
            await self._push_and_serve(epoch, proposal, model)
        finally:
            self._busy = False

    async def _push_and_serve(self, epoch: int, proposal: Proposal, model: str) -> None:
        """Offer, commit, activate (or abort everywhere), then serve; ends the bring-up. A
        plan served before is replaced make before break, as a heal's: the router moved
        live, then the old plan's hosts told it is over (``_retire``)."""
        old = self.serving
        try:
            pushed = push_plan(self._cluster, proposal, proposal.mode)
            epoch, done = await push(pushed, plans=self._plans, keyring=self._keyring,
                                     identity=self._identity, epoch=epoch,
                                     watch=self._bringup.watch)
            if not done.ok:
                self._bringup.failed(done.summary + "".join(f"; {n}" for n in proposal.notes))
                return
            if old is not None:
                self._plans.decide(old.epoch, "deactivated",
                                   superseded(epoch, "mlxctl cluster activate"))
            await self._serve(epoch, proposal.toml, model, done.summary, live=old is not None)
            if old is not None:
                self._tasks.create_task(self._retire(old, epoch))
        except MlxceldError as exc:
            self._bringup.failed(f"plan {epoch}: {exc.message}")
        except OSError as exc:  # writing cluster-E.toml or --cluster-config-out
            self._bringup.failed(f"plan {epoch}: cannot write {exc.filename}: {exc.strerror}")
        finally:
            self._busy = False

    async def _resume_at_start(self, last: PlanRow, n: int | None, configured: str | None,
                               mesh: MeshMode | None = None, *,
                               why: str = "after a restart") -> None:
        """Serve ``last`` again as it was (``_resume``), on the configured model when it is
        the plan's, else on the plan's own; a config that differs is reported, not applied.
        The caller has claimed the bring-up (``_claim``): this ends it."""
        epoch = last.epoch
        try:
            model, configured_identity = await asyncio.to_thread(
                resumed_model, last, self._state_dir / f"cluster-{epoch}.toml", configured)
            self.state = {"state": "pushing", "epoch": epoch, "model": str(model),
                          "stages": len(last.peers), "summary": "",
                          "peers": resumed_rows(last)}
            differs = config_differences(last, n, configured, configured_identity, mesh)
            if differs:
                self.state["config_differs"] = differs
                log.warning("plan %d is resumed as it was, though %s; to apply the config: "
                            "mlxctl cluster activate re-plans now (or deactivate, then "
                            "restart mlxceld)", epoch, differs)
                self._events.append("bringup.config_differs", "cluster",
                                    f"plan {epoch} resumed as it was, though {differs}",
                                    epoch=epoch)
            assert last.decision is not None and model is not None
            await self._resume(epoch, last.decision, last.toml, str(model), why)
        except MlxceldError as exc:
            self._bringup.failed(f"plan {epoch} cannot be resumed: {exc.message}")
        except OSError as exc:  # writing cluster-E.toml or --cluster-config-out
            self._bringup.failed(f"plan {epoch} cannot be resumed: {exc}")
        finally:
            self._busy = False

    async def deactivate(self) -> JSON:
        """`mlxctl cluster deactivate`: end the standing plan (``Plans.standing``: the
        newest committed or active, or deactivated already: then its peers are told again;
        an aborted heal after it is passed over); see ``deactivation``. A push of the
        latest plan, decided, is ended first."""
        await self._end_decided_push()
        self._claim()
        try:
            last = self._plans.standing()
            if last is None or last.decision not in (*RESUMABLE, "deactivated"):
                latest = self._plans.latest()
                what = (f"plan {latest.epoch} is {latest.decision or 'undecided'}" if latest
                        else "no plan was pushed from here")
                raise NoActivePlan(f"nothing to deactivate: {what}",
                                   hint="mlxctl status shows the last bring-up")
            if self._chase is not None:
                self._chase.cancel()
            epoch, reason = last.epoch, "mlxctl cluster deactivate"
            self._plans.decide(epoch, "deactivated", reason)
            self.serving = None
            log.info("plan %d: deactivated; stopping the router, telling %d peer(s)", epoch,
                     len(last.peers))
            outcomes, _ = await asyncio.gather(
                deactivation.tell(epoch, last.peers, keyring=self._keyring,
                                  identity=self._identity, reason=reason),
                self._slot.stop_pipeline())
            return self._deactivated(last, outcomes)
        finally:
            self._busy = False

    async def _end_decided_push(self) -> None:
        """If a push (or a resumed one) of the latest plan runs past its decision, commit or
        activate, cancel it and wait for it to end (its ``finally`` frees the bring-up)."""
        task, last = self._task, self._plans.latest()
        if (not self._busy or task is None or task.done() or last is None
                or last.decision not in ("commit", "activate")):
            return
        log.info("plan %d: a deactivation ends its push (decided %s)", last.epoch,
                 last.decision)
        task.cancel()
        await asyncio.wait({task})

    def _deactivated(self, plan: PlanRow, outcomes: dict[str, deactivation.Outcome]) -> JSON:
        left = self._bringup.deactivated(plan, outcomes)
        if left:
            self._chase = self._tasks.create_task(deactivation.chase(
                plan.epoch, left, self._bringup.told_late, keyring=self._keyring,
                identity=self._identity, reason="mlxctl cluster deactivate"))
        return self.state or {}

    async def _resume(self, epoch: int, decision: str, toml: str, model: str,
                      why: str) -> None:
        """A restart after a commit or activate decision (or a peer's query after a push
        that stalled) re-sends it until every peer is active; after ``active`` the pushed
        pipeline is served again as it was."""
        summary = f"plan {epoch}: resumed as decided ({decision})"
        if decision != "active":
            done = await resume_push(epoch, plans=self._plans, keyring=self._keyring,
                                     identity=self._identity, watch=self._bringup.watch, why=why)
            if not done.ok:
                self._bringup.failed(done.summary)
                return
            summary = done.summary
        await self._serve(epoch, toml, model, summary)

    async def _serve(self, epoch: int, toml: str, model: str, summary: str, *,
                     live: bool = False) -> None:
        path = self._state_dir / f"cluster-{epoch}.toml"
        path.write_text(toml)
        if self._config_out is not None:
            self._config_out.write_text(toml)
        placement = await asyncio.to_thread(place, path, "coordinator", model)
        await self._slot.serve_pipeline(placement, live=live)
        row = self._plans.get(epoch)
        cfg = placement.cluster
        self.serving = Served(epoch, model, row.peers if row else (), cfg.replicas,
                              cfg.tensor_parallel_size if cfg.mesh else 1)
        self._bringup.active(epoch, summary)

    async def heal(self, proposal: Proposal, old: Served, why: str, *, live: bool = False
                   ) -> tuple[bool, str]:
        """Self-healing (``healer.py``): push ``proposal``, a plan of ``old``'s model over
        the hosts alive, as a bring-up (one at a time: ``BringUpInProgress`` if one runs),
        with a new epoch; once it is active, ``old`` is recorded deactivated (superseded:
        a peer of it that asks hears so) and the router serves the new plan (``live``, as
        a drain's re-plan does: moved to it without a restart, its running requests
        ending on the old stages). Returns whether it is served, and the summary."""
        self._claim()
        self._task = asyncio.current_task()  # a deactivation ends it once decided
        try:
            epoch = self._plans.next_epoch()
            self.state = {"state": "planning", "model": old.model,
                          "stages": len(proposal.plan.stages), "summary": why}
            self._bringup.pushing(epoch, proposal.plan)
            row = self._plans.get(old.epoch)  # a heal keeps the --mesh its plan was made with
            pushed = push_plan(self._cluster, proposal, row.mesh if row else None)
            epoch, done = await push(pushed, plans=self._plans, keyring=self._keyring,
                                     identity=self._identity, epoch=epoch,
                                     watch=self._bringup.watch)
            if not done.ok:
                self._bringup.failed(done.summary)
                return False, done.summary
            self._plans.decide(old.epoch, "deactivated", superseded(epoch, why))
            await self._serve(epoch, proposal.toml, old.model, done.summary, live=live)
            return True, done.summary
        except MlxceldError as exc:
            self._bringup.failed(f"plan {self.state.get('epoch') if self.state else '?'}: "
                         f"{exc.message}")
            return False, exc.message
        except OSError as exc:  # writing cluster-E.toml or --cluster-config-out
            self._bringup.failed(f"cannot write {exc.filename}: {exc.strerror}")
            return False, f"cannot write {exc.filename}: {exc.strerror}"
        finally:
            self._busy = False

    async def old_plan_retired(self) -> bool:
        """After a live move (``heal(live=True)``): whether the router closed the old
        plan's engine, its sequences ended on the old stages, within ``RETIRED_WAIT_S``."""
        return await self._slot.old_plan_retired(RETIRED_WAIT_S)

    async def _retire(self, old: Served, epoch: int) -> None:
        """Once the router's engine of ``old`` closed, each of its hosts hears that it is
        over (``retiring.py``): the stage it kept serving while plan ``epoch`` came up
        stops, or its stage of ``old``."""
        try:
            done = await retiring.retire(old.epoch, old.peers, epoch,
                                         closed=self.old_plan_retired,
                                         keyring=self._keyring, identity=self._identity)
        except Exception:  # a bug: logged; never ends the daemon's task group
            log.exception("plan %d: telling its hosts it is over failed", old.epoch)
            return
        log.info("plan %d, superseded by plan %d: its hosts told it is over (%s)", old.epoch,
                 epoch, done.said())

