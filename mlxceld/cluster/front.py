"""The ``plan`` exchange on MXCL channel 3 (agent): the pipeline a coordinator serves.

A router in front of a pipeline (``--node-role router --pipeline-coordinator ADDR``,
``config/front.py``) asks the coordinator's agent which plan its router serves, and
drives those stages itself (``daemon/following.py`` asks and follows).

Messages (the envelope of PROTOCOL.md section 4, header only; ``PlanRequest`` and
``Plan`` in ``wire/agent_messages.py``; our own exchange over channel 3's framing,
not a change to it):

====== ================ ======================================================
type   direction        fields
====== ================ ======================================================
plan   asker → agent    none besides ``t``: ``{"t": "plan"}``
plan   agent → asker    ``epoch`` (the plan's, or null), ``cluster`` (its
                        name), ``model`` (its identity, 64 hex digits),
                        ``stages``: [{``node``, ``address`` (the stage's
                        listener, ``host:port``), ``rank``, ``layers``
                        [start, end), ``tp_group`` (a 2D mesh's stage only:
                        its ranks' agent addresses, ``host:port``, in rank
                        order, 2 to 16, the same size for every stage)}, ...]
                        in rank order; ``stages`` empty and the rest null
                        when its router serves no pipeline plan (none
                        activated, deactivated, a router over replica groups,
                        or not a coordinator)
error  agent → asker    ``reason`` (an agent that does not serve the type)
====== ================ ======================================================

``tp_group`` is left out of a pipeline's stages, so that a pipeline's answer is the one
of before, byte for byte; an asker of this release reads a stage without it as no group.
A standby (``daemon/standby.py``) that adopts a 2D mesh knows every rank's host from it,
and heals the mesh as the coordinator would (``healer.py``: ``--mesh auto`` over the hosts
alive), not as a pipeline of its rank-0 hosts.

The stages are those its router drives now: after a live switch (a drain's re-plan, a
heal), the new plan's. The coordinator remembers who asked and when (``Fronts``): make
before break's end (``daemon/serving.py``'s ``old_plan_retired``) waits, besides for its
own router, for every router that asked within ``ACTIVE_S`` to have asked again since the
switch (so it drives the new stages) before the old plan's stages stop.

The asker's budget: ``CONNECT_BUDGET_S`` (3 s) to connect and authenticate, then
``ANSWER_TIMEOUT_S`` (3 s) for the answer; ``PlanNotFound`` says why there is none. Any
holder of the cluster secret may ask: the stages' addresses are no secret from those who
may drive them (``pipeline/protocol.py``'s authorization).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from mlxceld.cluster.coordinator import Served
from mlxceld.discovery.inventory import AGENT_CHANNEL
from mlxceld.errors import MlxceldError
from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService, ask
from mlxceld.net.errors import AskFailed
from mlxceld.roles.options import PipelineOptions, PipelineStage
from mlxceld.wire import Envelope, MessageSpec, SecretStore, encode_envelope
from mlxceld.wire.address import bound_identity
from mlxceld.wire.agent_messages import Plan, PlanRequest, PlanStage
from mlxceld.wire.messages import MessageError

ANSWER_SPECS: Final = {Plan.T: MessageSpec(), "error": MessageSpec()}
CONNECT_BUDGET_S: Final = 3.0
ANSWER_TIMEOUT_S: Final = 3.0
NO_PLAN: Final = Plan(None, None, None, ())
ACTIVE_S: Final = 10.0  # a router that asked this recently is one to wait for (Fronts)


class PlanNotFound(MlxceldError):
    """The coordinator's plan could not be had: unreachable, or a bad answer."""

    code = "plan_not_found"


def plan_of(pipeline: PipelineOptions | None, served: Served | None) -> Plan:
    """The answer for a router that drives ``pipeline`` (None: no plan) of the plan the
    coordinator serves (``served``: its epoch and, of a 2D mesh, every rank's host)."""
    if pipeline is None:
        return NO_PLAN
    groups = groups_of(served, len(pipeline.stages))
    return Plan(served.epoch if served else None, pipeline.cluster, pipeline.model_identity,
                tuple(PlanStage(s.node_id, s.address, s.rank, s.layers, g)
                      for s, g in zip(pipeline.stages, groups, strict=True)))


def groups_of(served: Served | None, stages: int) -> list[tuple[str, ...]]:
    """Each of ``stages`` stages' tensor group in ``served`` (its ``peers``, every rank's
    host, stage by stage), or () each: a pipeline, or a plan the router does not drive
    yet (the next answer has them)."""
    size = served.tp_size if served else 1
    peers = served.peers if served else ()
    if size < 2 or len(peers) != stages * size:
        return [()] * stages
    return [tuple(peers[i:i + size]) for i in range(0, len(peers), size)]


def pipeline_of(plan: Plan, origin: str) -> PipelineOptions | None:
    """The router's ``pipeline`` option over ``plan``'s stages, dialing as ``origin`` (our
    agent address); None for a plan with no stages."""
    if not plan.stages or plan.model is None or plan.cluster is None:
        return None
    return PipelineOptions(
        stages=tuple(PipelineStage(s.node_id, s.address, s.rank, s.layers)
                     for s in plan.stages),
        coordinator=origin, model_identity=plan.model, cluster=plan.cluster)


class Fronts:
    """The routers in front of this coordinator's pipeline: who asked for the plan, when
    (``time.monotonic()``)."""

    def __init__(self) -> None:
        self._asked: dict[str, float] = {}

    def asked(self, who: str, now: float) -> None:
        self._asked[who] = now
        for old in [w for w, t in self._asked.items() if now - t > ACTIVE_S]:
            del self._asked[old]

    def behind(self, since: float, now: float) -> list[str]:
        """The routers that asked within ``ACTIVE_S`` of ``now``, but not since ``since``
        (they may still send new sequences to the stages of the plan before)."""
        return sorted(w for w, t in self._asked.items() if now - t <= ACTIVE_S and t < since)


def serve_plan(agent: AgentService, answer: Callable[[], Plan],
               fronts: Fronts | None = None) -> None:
    """Answer ``plan`` on the agent channel with what ``answer`` says now; who asked is
    told to ``fronts``."""

    async def handle(stream: MxclStream, message: Envelope) -> None:
        await stream.send(encode_envelope(answer().to_wire()))
        if fronts is not None:
            who = bound_identity(stream.peer_identity, stream.peer)
            fronts.asked(str(who), time.monotonic())

    agent.add_handler(AGENT_CHANNEL, Plan.T, handle)


async def ask_plan(origin: str, agent: str, *, keyring: SecretStore) -> Plan:
    """Ask the agent at ``agent`` as the node whose agent is ``origin``; the checked
    answer, or ``PlanNotFound`` saying why there is none. At most ``CONNECT_BUDGET_S +
    ANSWER_TIMEOUT_S``."""
    try:
        answer = await ask(origin, agent, PlanRequest(), keyring=keyring, channel=AGENT_CHANNEL,
                           answers=ANSWER_SPECS, connect_s=CONNECT_BUDGET_S,
                           answer_s=ANSWER_TIMEOUT_S)
    except AskFailed as exc:
        raise PlanNotFound(f"coordinator {agent}: {exc.message}") from None
    try:
        return Plan.from_wire(answer.header)
    except MessageError as exc:
        raise PlanNotFound(f"coordinator {agent} answered {exc.reason}") from None
