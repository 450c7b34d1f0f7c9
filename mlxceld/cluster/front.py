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
                        [start, end)}, ...] in rank order; ``stages`` empty
                        and the rest null when its router serves no
                        pipeline plan (none activated, deactivated, a router
                        over replica groups, or not a coordinator)
error  agent → asker    ``reason`` (an agent that does not serve the type)
====== ================ ======================================================

The stages are those its router drives now: after a live switch (a drain's re-plan, a
heal), the new plan's. The asker's budget: ``CONNECT_BUDGET_S`` (3 s) to connect and
authenticate, then ``ANSWER_TIMEOUT_S`` (3 s) for the answer; ``PlanNotFound`` says why
there is none. Any holder of the cluster secret may ask: the stages' addresses are no
secret from those who may drive them (``pipeline/protocol.py``'s authorization).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from mlxceld.discovery.inventory import AGENT_CHANNEL
from mlxceld.errors import MlxceldError
from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService, ask
from mlxceld.net.errors import AskFailed
from mlxceld.roles.options import PipelineOptions, PipelineStage
from mlxceld.wire import Envelope, MessageSpec, SecretStore, encode_envelope
from mlxceld.wire.agent_messages import Plan, PlanRequest, PlanStage
from mlxceld.wire.messages import MessageError

ANSWER_SPECS: Final = {Plan.T: MessageSpec(), "error": MessageSpec()}
CONNECT_BUDGET_S: Final = 3.0
ANSWER_TIMEOUT_S: Final = 3.0
NO_PLAN: Final = Plan(None, None, None, ())


class PlanNotFound(MlxceldError):
    """The coordinator's plan could not be had: unreachable, or a bad answer."""

    code = "plan_not_found"


def plan_of(pipeline: PipelineOptions | None, epoch: int | None) -> Plan:
    """The answer for a router that drives ``pipeline`` (None: no plan)."""
    if pipeline is None:
        return NO_PLAN
    return Plan(epoch, pipeline.cluster, pipeline.model_identity,
                tuple(PlanStage(s.node_id, s.address, s.rank, s.layers)
                      for s in pipeline.stages))


def pipeline_of(plan: Plan, origin: str) -> PipelineOptions | None:
    """The router's ``pipeline`` option over ``plan``'s stages, dialing as ``origin`` (our
    agent address); None for a plan with no stages."""
    if not plan.stages or plan.model is None or plan.cluster is None:
        return None
    return PipelineOptions(
        stages=tuple(PipelineStage(s.node_id, s.address, s.rank, s.layers)
                     for s in plan.stages),
        coordinator=origin, model_identity=plan.model, cluster=plan.cluster)


def serve_plan(agent: AgentService, answer: Callable[[], Plan]) -> None:
    """Answer ``plan`` on the agent channel with what ``answer`` says now."""

    async def handle(stream: MxclStream, message: Envelope) -> None:
        await stream.send(encode_envelope(answer().to_wire()))

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
