"""A standby coordinator: a router in front of a pipeline that takes over its healing.

With ``--standby`` (``[serve] standby = true``, ``config/front.py``) the router that
follows a coordinator's plan (``daemon/following.py``) also watches for its
coordinator's end. The takeover rule, looked at every ``following.FOLLOW_S`` (1 s):

- the follower has found the coordinator unreachable (no answer to its ``plan`` ask)
  without a break for the failure detector's dead time (``[daemon] peer_dead_after_s``,
  default 10 s: the bound after which a coordinator would heal a silent stage host);
- every stage host of the plan followed is a candidate of this daemon (list them in
  ``--cluster-peers``, as for any coordinator) whose failure detector says it is alive;
- no stage host still hears the coordinator: each is asked (the ``assignment`` question,
  ``cluster/lease.py``'s ``still_heard``) and none says its lease on the coordinator
  runs, or holds a newer plan than the one followed. A coordinator cut off from this
  standby alone still reaches its stage hosts: it keeps its lease and coordinates alone,
  and the standby says so (``why``: "coordinator unreachable from here but heard by stage
  peers 0.8 s ago; not taking over"; event ``standby.held`` once per hold).

Then this daemon adopts the plan (``cluster/adoption.py``; a 2D mesh's with each stage's
tensor group, every rank's host a stage host): it is the plan's coordinator
for healing and drains from now on, its follower stops asking (event
``standby.took_over``), and ``mlxctl drain <stage host>`` here re-plans around the host,
a silent stage host is healed (``cluster/healer.py``), each push with a newer epoch that
the peers take. Its router keeps serving throughout: the plan followed, then the plans it
pushes (``roster.py``: the coordinator's placement wins over the plan followed).

The bound, from the coordinator's end (its host gone, or its daemon stopped) to the
takeover: the first failed ask (``FOLLOW_S``, plus at most the ask's budget,
``front.CONNECT_BUDGET_S + ANSWER_TIMEOUT_S``, 6 s, when the host is silent rather than
refusing connections), then the dead time, then at most one more look, whose lease
questions to the stage hosts take at most ``lease.ASK_CONNECT_S + ASK_ANSWER_S`` (4 s).
The stage hosts' leases run out within their own dead time of the coordinator's end,
inside the same span when the dead times agree: ``TAKEOVER_BOUND_S`` past the dead time
(the longer of this daemon's and the stage hosts'), 12 s (22 s with the defaults).

A takeover is one-way for this daemon's life: the old coordinator that comes back is
not followed again (it stands down on learning that the peers serve a newer plan; see
docs/several-routers.md). A stage host that does not answer, or is no candidate, holds
the takeover back (``state`` stays ``standing by``, the reason in ``mlxctl status``):
a takeover over dead hosts would heal at once over whatever is left, a decision left to
the operator.

``describe`` is ``mlxctl status``'s ``standby``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from mlxceld.cluster.front import ANSWER_TIMEOUT_S, CONNECT_BUDGET_S
from mlxceld.cluster.lease import ASK_ANSWER_S, ASK_CONNECT_S, StillHeard
from mlxceld.daemon.following import FOLLOW_S, PlanFollower
from mlxceld.state import EventLog
from mlxceld.types import JSON
from mlxceld.wire.agent_messages import Plan

log = logging.getLogger(__name__)

# From the host's end to the takeover, past the dead time (the module docstring).
TAKEOVER_BOUND_S: Final = (FOLLOW_S + CONNECT_BUDGET_S + ANSWER_TIMEOUT_S + FOLLOW_S
                           + ASK_CONNECT_S + ASK_ANSWER_S)

# ClusterMember.adopt: None, or why not (the lease still held by the coordinator: StillHeard)
Adopt = Callable[[Plan, str], Awaitable[StillHeard | str | None]]


class Standby:
    def __init__(self, follower: PlanFollower, adopt: Adopt, events: EventLog, *,
                 dead_after_s: Callable[[], float]) -> None:
        self._follower = follower
        self._adopt = adopt
        self._events = events
        self._dead_after_s = dead_after_s
        self._closing = asyncio.Event()
        self.state = "standing by"  # standing by | took over
        self.since = time.time()
        self.why: str | None = None  # what holds a takeover back, while one does
        self.epoch: int | None = None  # the plan adopted
        self._held: StillHeard | None = None  # the lease holding a takeover back, if it does

    def describe(self) -> JSON:
        """``mlxctl status``'s ``standby``."""
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        coordinator = self._follower.coordinator
        plan = self._follower.plan
        tp_size = plan.tp_size if plan is not None else 1
        if self.state == "took over":
            mesh = (f", {len(plan.stages)} stage(s) x tp {tp_size}" if plan and tp_size > 1
                    else "")
            summary = (f"took over at {when} from coordinator {coordinator} (plan "
                       f"{self.epoch}{mesh}): this daemon coordinates the pipeline now")
        else:
            summary = f"standing by for coordinator {coordinator}" + (
                f"; no takeover: {self.why}" if self.why else "")
        return {"state": self.state, "since": self.since, "coordinator": coordinator,
                "epoch": self.epoch, "tp_size": tp_size, "why": self.why,
                "took_over": self.state == "took over",
                "dead_after_s": self._dead_after_s(), "bound_s": TAKEOVER_BOUND_S,
                "summary": summary}

    async def run(self) -> None:
        """Look every ``FOLLOW_S`` until a takeover or ``close``."""
        while not self._closing.is_set() and self.state == "standing by":
            try:
                await self.look()
            except Exception:  # a bug: logged; never ends the daemon
                log.exception("standby: the takeover look failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), FOLLOW_S)

    def close(self) -> None:
        self._closing.set()

    async def look(self) -> None:
        """Take over if the rule of the module docstring holds."""
        f = self._follower
        if f.state != "unreachable" or f.plan is None or not f.plan.stages:
            self.why = self._held = None
            return
        gone_s = time.time() - f.since
        if gone_s < self._dead_after_s():
            self.why = self._held = None
            return
        why = await self._adopt(f.plan, str(f.coordinator))
        if f.state != "unreachable":  # it answered meanwhile
            return
        if isinstance(why, StillHeard):
            self._still_heard(why, gone_s)
            return
        self._held = None
        if why is not None:
            if why != self.why:
                log.warning("standby: coordinator %s unreachable for %.0f s, no takeover: %s",
                            f.coordinator, gone_s, why)
            self.why = why
            return
        f.close()  # one-way: the follower asks no more
        self.state, self.since, self.why, self.epoch = "took over", time.time(), None, f.plan.epoch
        self._held = None
        log.warning("standby: coordinator %s unreachable for %.0f s: took over plan %s",
                    f.coordinator, gone_s, f.plan.epoch)
        self._events.append("standby.took_over", "front", f"coordinator {f.coordinator} "
                            f"unreachable for {gone_s:.0f} s: this standby took over plan "
                            f"{f.plan.epoch}", epoch=f.plan.epoch, coordinator=f.coordinator,
                            gone_s=round(gone_s, 3))

    def _still_heard(self, held: StillHeard, gone_s: float) -> None:
        """The coordinator, unreachable from here, still heard by a stage host: no takeover;
        logged and an event once per hold (``standby.held``), the status kept current."""
        self.why = held.summary
        if self._held is None:
            f = self._follower
            log.warning("standby: coordinator %s unreachable for %.0f s: %s", f.coordinator,
                        gone_s, held.summary)
            self._events.append("standby.held", "front", held.summary, coordinator=f.coordinator,
                                holder=held.holder, peer=held.peer, heard_s=held.heard_s,
                                lease_s=held.lease_s, gone_s=round(gone_s, 3))
        self._held = held
