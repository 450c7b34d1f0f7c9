"""Fencing a coordinator that a standby superseded: it stands down instead of resuming.

A standby coordinator (``daemon/standby.py``) that took over a plan pushes its own plans
(a heal, a drain's re-plan) to the stage hosts, each with a newer epoch than the old
coordinator's. When the old coordinator's daemon comes back on its state dir, its plans
table still says its plan is active: resumed as is, its router would drive stages that
no longer serve that plan, and its healer would heal or push against the standby.

So, before resuming (``ClusterMember``: at the daemon's start, before ``Coordinator.start``
and before a peer's query pushes a plan on), it asks each peer of the plan it would
resume which plan that peer holds (``ask_assignment``): the ``assignment`` question on
MXCL channel 3, answered from the peer's assignments table (``serve_assignment``):

========== ============== =============================================================
type       direction      fields
========== ============== =============================================================
assignment asker → peer   none besides ``t``
assignment peer → asker   ``epoch`` (the newest plan it recorded, or null), ``coordinator``
                          (the agent address that offered it), ``state`` (its state);
                          its lease (``cluster/lease.py``): ``holder`` (the coordinator
                          of the newest plan it holds a stage of, or null), ``held``
                          (that plan's epoch), ``heard_s`` (seconds since it last heard
                          the holder), ``lease_s`` (seconds the lease still runs, 0 once
                          expired); the four null when it holds no stage
========== ============== =============================================================

A peer that holds a plan newer than ours, offered by another coordinator, means ours was
superseded (``superseded``): this daemon stands down (``Fence``). Its plan is recorded
deactivated, superseded by that one (so its next start does not ask again); it resumes
nothing and pushes nothing; the router its start put back over the plan
(``resumed_placement``: before the peers could be asked, so that a router left running is
re-adopted) is stopped once they answered; its healer has no plan to heal; a peer's
query pushes nothing on; event ``coordinator.stood_down`` and `mlxctl status`
(``stood_down``) name who coordinates now. It does not follow the new coordinator as a
router (its role is unchanged): to make it a front of the pipeline, restart it with
``--node-role router --pipeline-coordinator`` that address.

Peers that do not answer (each ask bounded by ``CONNECT_S + ANSWER_S``, all at once) do
not hold the resume back: with none of them naming a newer plan, the plan is resumed as
before (a restart while the peers are down serves again as soon as they are back).

Peers refuse an offer from another coordinator while their plan's coordinator holds
their lease (``cluster/lease.py``: heard within the dead time), and a standby takes over
only once its stage hosts say that lease ran out, so a coordinator cut off from its
standby alone keeps coordinating. Past the lease the epoch decides (``peer_round``'s
``stale``): the old coordinator stands down at its next start; one that comes back
without a restart is not fenced here (its next push is refused by a peer that took the
standby's: the standby holds its lease, and its epoch is newer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from mlxceld.cluster.assignment import deactivation
from mlxceld.discovery.inventory import AGENT_CHANNEL
from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService, ask
from mlxceld.net.errors import AskFailed
from mlxceld.state import EventLog
from mlxceld.state.plans import Assignments, Plans
from mlxceld.state.plans import superseded as superseded_plan
from mlxceld.types import JSON
from mlxceld.wire import Envelope, Keyring, MessageSpec, SecretStore, encode_envelope
from mlxceld.wire.agent_messages import Assignment, AssignmentRequest
from mlxceld.wire.messages import MessageError

if TYPE_CHECKING:
    from mlxceld.cluster.lease import Lease

log = logging.getLogger(__name__)

CONNECT_S: Final = 3.0
ANSWER_S: Final = 3.0


@dataclass(frozen=True)
class Superseded:
    """Our plan ``ours`` was superseded by plan ``epoch`` of ``coordinator``, as ``peer``
    said."""

    ours: int
    epoch: int
    coordinator: str
    peer: str

    @property
    def summary(self) -> str:
        return (f"plan {self.ours} was superseded by plan {self.epoch} of coordinator "
                f"{self.coordinator} (peer {self.peer} serves it): this daemon stands down "
                "and coordinates nothing")


def serve_assignment(agent: AgentService, assignments: Assignments, lease: Lease) -> None:
    """Answer ``assignment`` with the newest assignment recorded here (none: all null) and
    the lease."""

    async def handle(stream: MxclStream, message: Envelope) -> None:
        row = assignments.latest()
        answer = await lease.answer(None if row is None
                                    else (row.epoch, row.coordinator, row.state))
        await stream.send(encode_envelope(answer.to_wire()))

    agent.add_handler(AGENT_CHANNEL, AssignmentRequest.T, handle)


async def ask_assignment(identity: str, peer: str, *, keyring: SecretStore,
                         connect_s: float = CONNECT_S, answer_s: float = ANSWER_S
                         ) -> Assignment | None:
    """What ``peer`` holds, asked as ``identity``; None when it cannot be asked."""
    try:
        answer = await ask(identity, peer, AssignmentRequest(), keyring=keyring,
                           channel=AGENT_CHANNEL,
                           answers={Assignment.T: MessageSpec(), "error": MessageSpec()},
                           connect_s=connect_s, answer_s=answer_s)
        return Assignment.from_wire(answer.header)
    except (AskFailed, MessageError) as exc:
        log.info("peer %s not asked which plan it holds: %s", peer, exc)
        return None


async def superseded(epoch: int, peers: Sequence[str], *, identity: str,
                     keyring: SecretStore) -> Superseded | None:
    """Whether a peer of our plan ``epoch`` holds a newer plan of another coordinator."""
    answers = await asyncio.gather(*(ask_assignment(identity, p, keyring=keyring)
                                     for p in peers))
    newer = [(a.epoch, a.coordinator, p) for p, a in zip(peers, answers, strict=True)
             if a is not None and a.epoch is not None and a.coordinator is not None
             and a.epoch > epoch and a.coordinator != identity]
    if not newer:
        return None
    e, coordinator, peer = max(newer)
    return Superseded(epoch, e, coordinator, peer)


class Fence:
    """A coordinator's start, fenced: whether it stood down, and why (``stood_down``)."""

    def __init__(self, plans: Plans, events: EventLog) -> None:
        self._plans = plans
        self._events = events
        self.stood_down: Superseded | None = None

    def describe(self) -> JSON | None:
        """``mlxctl status``'s ``stood_down``."""
        s = self.stood_down
        return None if s is None else {"epoch": s.ours, "superseded_by": s.epoch,
                                       "coordinator": s.coordinator, "peer": s.peer,
                                       "summary": s.summary}

    async def start(self, resume: Callable[[], None], stop: Callable[[], Awaitable[None]],
                    *, identity: str, keyring: Keyring,
                    asking: Callable[[int], None] | None = None) -> None:
        """``resume`` (``Coordinator.start``) unless a peer of the plan it would resume
        holds a newer one of another coordinator: then that plan is recorded deactivated,
        superseded, and this daemon stands down: ``stop`` (``stop_pipeline``) drops the
        placement the daemon's start put back and stops the router over it. A plan a
        standby adopted (``cluster/adoption.py``: no cluster file) is not resumed.
        ``asking(epoch)``: called before the peers are asked (the bring-up's status says
        so meanwhile: ``Coordinator.checking``)."""
        last = self._plans.resumable()
        if last is not None and not last.toml:  # a standby's adopted plan: nothing to place
            return
        if last is not None and asking is not None:
            asking(last.epoch)
        found = None if last is None else await superseded(
            last.epoch, last.peers, identity=identity, keyring=keyring)
        if found is None or last is None:
            resume()
            return
        self.stood_down = found
        self._plans.decide(found.ours, "deactivated",
                           superseded_plan(found.epoch, f"coordinator {found.coordinator}"))
        log.warning("%s", found.summary)
        await stop()
        # Its hosts the new plan left out (a drained one) stop their stage of it: the
        # standby's word was refused there (the plan came from here); the others only
        # record it (superseded there already).
        told = await deactivation.tell(found.ours, last.peers, keyring=keyring,
                                       identity=identity, reason=found.summary)
        log.info("plan %d: its hosts told it is over (%s)", found.ours,
                 ", ".join(f"{a}: {o[0]}" for a, o in sorted(told.items())))
        self._events.append("coordinator.stood_down", "cluster", found.summary,
                            epoch=found.ours, superseded_by=found.epoch,
                            coordinator=found.coordinator)
