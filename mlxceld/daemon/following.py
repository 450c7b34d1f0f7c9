"""A router in front of a pipeline follows the plan its coordinator serves.

On a daemon with ``--node-role router`` and ``[serve] pipeline_coordinator``
(``config/front.py``), ``PlanFollower`` asks the coordinator's agent for its plan
(``cluster/front.py``'s ``plan``) every ``FOLLOW_S`` (1 s), each ask bounded by that
exchange's budget (3 s to connect, 3 s to answer), and:

- a plan with stages that differs from the one followed (the first, a heal, a drain's
  re-plan, an activate): the roster's ``followed`` is set to it and reconciled (the
  router starts over it, the first time); a running router is moved to the new stages
  with the live switch (its ``pipeline`` op, ``pipeline/switch.py``: new sequences go to
  the new stages, running ones end on the old), and restarted only if it refuses or does
  not answer. So a re-plan reaches this router within ``FOLLOW_S`` plus one ask after the
  coordinator's own router moved (at most ``FOLLOW_S + 6 s``, the ask's budget);
- a plan of another model (its identity is not that of ``[serve] model`` here): not
  followed; the status says why, once in the log;
- no plan (deactivated) said for ``NONE_FOR_S`` (10 s) in a row: the router stops (the
  stages were told to stop too); a coordinator restarting says no plan for a moment
  before it resumes its plan, which the bound rides out;
- no answer (the coordinator's host is down, or its daemon restarting): the router keeps
  serving the plan it follows, whose stages serve every router of the plan on their own
  (``pipeline/protocol.py``); the status says since when the coordinator is unreachable.

The plan followed is kept in the settings table (``front.plan``, with the coordinator it
came from, the model and our identity then): a router daemon restarted while its
coordinator is down serves that plan at once (``restore``, before its first reconcile, so
that its router worker left running is re-adopted; state ``unreachable``) and follows the
coordinator's again as soon as it answers.
A plan that changed meanwhile is learnt then; until then, a stage of the kept plan that is
gone fails its requests as any lost stage does.

``describe`` is ``mlxctl status``'s ``front``. It lives in the daemon room beside
``root.py``, which makes it and runs it; it changes the roster and asks the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from mlxceld.cluster.front import PlanNotFound, ask_plan, pipeline_of
from mlxceld.config.front import FOLLOW_S as FOLLOW_S  # re-exported: standby.py's look
from mlxceld.config.serve import ROUTER
from mlxceld.daemon.roster import Roster
from mlxceld.models.identity import model_identity
from mlxceld.roles.options import PipelineOptions, options_json
from mlxceld.state import EventLog, Settings
from mlxceld.supervisor.ops import Pipeline
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import JSON
from mlxceld.wire.agent_messages import Plan
from mlxceld.wire.messages import MessageError
from mlxceld.wire.secret import Keyring

log = logging.getLogger(__name__)

NONE_FOR_S: Final = 10.0  # "no plan" said this long in a row stops the router
KEPT: Final = "front.plan"  # the settings key of the plan followed


class PlanFollower:
    def __init__(self, roster: Roster, supervisor: Supervisor, events: EventLog,
                 keyring: Keyring, settings: Settings, *,
                 origin: Callable[[], str | None]) -> None:
        """``origin``: our agent listener's address once bound (the identity we ask and
        dial the stages with)."""
        self._roster = roster
        self._supervisor = supervisor
        self._events = events
        self._keyring = keyring
        self._settings = settings
        self._origin = origin
        self._closing = asyncio.Event()
        self._identity: tuple[str, str] | None = None  # (model path, its identity)
        self.epoch: int | None = None
        self.plan: Plan | None = None  # the plan followed (a standby adopts it)
        self.state = "waiting"  # waiting | following | unreachable | refused | stopped
        self.since = time.time()
        self.error: str | None = None
        self._none_since: float | None = None

    @property
    def coordinator(self) -> str | None:
        return self._roster.config.serve.pipeline_coordinator

    def describe(self) -> JSON | None:
        """``mlxctl status``'s ``front``: whom this router follows and how it goes."""
        if self.coordinator is None:
            return None
        followed = self._roster.followed
        stages = [s.node_id for s in followed.stages] if followed else []
        return {"coordinator": self.coordinator, "state": self.state, "since": self.since,
                "epoch": self.epoch, "stages": stages, "error": self.error,
                "summary": self._summary(len(stages))}

    def _summary(self, stages: int) -> str:
        """One line for ``mlxctl status``: whom it follows, and since when it cannot."""
        plan = f"plan {self.epoch} ({stages} stages)" if stages else "no plan yet"
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        if self.state == "following":
            return f"following coordinator {self.coordinator}: {plan}"
        if self.state == "unreachable":
            return (f"coordinator {self.coordinator} unreachable since {when} "
                    f"({self.error}); serving on with {plan}")
        if self.state == "refused":
            return f"not following coordinator {self.coordinator}: {self.error}"
        return f"coordinator {self.coordinator}: {self.state} since {when}; {plan}"

    async def run(self) -> None:
        """Ask and follow every ``FOLLOW_S`` until ``close``."""
        while not self._closing.is_set():
            if self.coordinator is not None and self._origin() is not None:
                try:
                    await self.follow_once()
                except Exception as exc:  # never ends the daemon: asked again
                    log.warning("could not follow coordinator %s's plan: %s",
                                self.coordinator, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), FOLLOW_S)

    def close(self) -> None:
        self._closing.set()

    def restore(self) -> None:
        """Before the daemon's first reconcile: the plan kept before a restart, if it came
        from our coordinator for our model, is the roster's again (a router worker left
        running is re-adopted, not stopped); ``run`` then asks for the current one."""
        kept = self._settings.get(KEPT)
        if (self.coordinator is None or not isinstance(kept, dict)
                or kept.get("coordinator") != self.coordinator
                or kept.get("model") != self._roster.serve.model
                or not isinstance(kept.get("origin"), str)):
            return
        try:
            plan = Plan.from_wire(kept.get("plan") or {})
        except MessageError:
            return
        self._roster.followed = pipeline_of(plan, str(kept["origin"]))
        if self._roster.followed is not None:
            log.info("serving plan %s kept before the restart until coordinator %s answers",
                     plan.epoch, self.coordinator)
            self.epoch, self.plan = plan.epoch, plan
            self._set("unreachable", "not asked yet since the restart")

    async def follow_once(self) -> None:
        """One ask, and what its answer changes (the module docstring)."""
        coordinator, origin = self.coordinator, self._origin()
        assert coordinator is not None and origin is not None
        try:
            plan = await ask_plan(origin, coordinator, keyring=self._keyring)
        except PlanNotFound as exc:
            self._set("unreachable", exc.message)
            return
        if not plan.stages:
            await self._no_plan()
            return
        self._none_since = None
        wanted = pipeline_of(plan, origin)
        ours = await self._model_identity()
        if plan.model != ours:
            self._set("refused", f"coordinator {coordinator} serves model "
                      f"{str(plan.model)[:12]}…, this router's [serve] model is "
                      f"{str(ours)[:12]}…: give both the same model files")
            return
        self.epoch, self.plan = plan.epoch, plan
        if wanted != self._roster.followed:
            await self._move(wanted, plan)
        self._set("following", None)

    async def _no_plan(self) -> None:
        now = time.monotonic()
        if self._none_since is None:
            self._none_since = now
        if now - self._none_since < NONE_FOR_S or self._roster.followed is None:
            return
        log.info("coordinator %s serves no plan for %.0f s: this router stops",
                 self.coordinator, NONE_FOR_S)
        self._events.append("front.stopped", "front", f"coordinator {self.coordinator} serves "
                            "no pipeline plan: the router stops")
        self._roster.followed, self.epoch, self.plan = None, None, None
        self._settings.delete(KEPT)
        await self._roster.reconcile()
        self._set("stopped", None)

    async def _move(self, wanted: PipelineOptions | None, plan: Plan) -> None:
        """Follow ``wanted``: the roster reconciled, a running router moved live (else
        restarted)."""
        existed = ROUTER in self._supervisor.names()
        self._roster.followed = wanted
        self._settings.put(KEPT, {"coordinator": self.coordinator, "plan": plan.to_wire(),
                                  "model": self._roster.serve.model,
                                  "origin": wanted.coordinator if wanted else None})
        await self._roster.reconcile()
        spec = self._roster.spec(ROUTER)
        nodes = [s.node_id for s in plan.stages]
        self._events.append("front.followed", "front", f"following plan {plan.epoch} of "
                            f"coordinator {self.coordinator}: stages {nodes}",
                            epoch=plan.epoch, stages=nodes)
        if not existed or spec is None:
            return
        reply = await self._supervisor.call_running(ROUTER, Pipeline(options_json(spec.options)))
        if reply is not None and reply.get("ok"):
            log.info("router moved to plan %s's stages without a restart", plan.epoch)
            return
        log.info("router not moved live (%s): restarting it",
                 "no answer" if reply is None else reply.get("error"))
        self._supervisor.restart(ROUTER)

    async def _model_identity(self) -> str | None:
        model = self._roster.serve.model
        if model is None:
            return None
        if self._identity is None or self._identity[0] != model:
            self._identity = (model, await asyncio.to_thread(model_identity, Path(model)))
        return self._identity[1]

    def _set(self, state: str, error: str | None) -> None:
        if state != self.state:
            self.since = time.time()
            if state == "unreachable":
                log.warning("coordinator %s unreachable (%s): serving on with plan %s",
                            self.coordinator, error, self.epoch)
            elif state == "refused":
                log.error("%s", error)
            self.state = state
        self.error = error
