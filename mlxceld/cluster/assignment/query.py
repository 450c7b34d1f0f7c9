"""A plan's ``query`` on channel 2: "what did you decide for this epoch?".

A peer asks it of its coordinator (``ask_decision``) when its round waited a phase
without word (``peer_round.Query``), and before it brings back a stage recorded active
at its start; one ``net.agent.ask``: ``CONNECT_S`` to connect, then
``peer_round.FRAME_S`` for the ``decision``. The coordinator answers from its
``plans`` table (``serve_queries``): the decision written, ``abort`` for a plan not
decided, ``unknown`` for one it never heard of; a peer that asks tells the coordinator
it is back (``Coordinator.peer_asked``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mlxceld.cluster.assignment.peer_round import FRAME_S
from mlxceld.cluster.assignment.push import ASSIGNMENT_CHANNEL, CONNECT_S, epoch_of, sent
from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService, ask
from mlxceld.net.errors import AskFailed
from mlxceld.state.plans import Plans
from mlxceld.wire import Envelope, MessageSpec, SecretStore
from mlxceld.wire.assignment_messages import Decision, DecisionQuery
from mlxceld.wire.messages import MessageError

log = logging.getLogger(__name__)

Asked = Callable[[int, str], None]  # a peer asked about plan epoch, and heard this decision


async def ask_decision(identity: str, coordinator: str, epoch: int, *,
                       keyring: SecretStore) -> tuple[str | None, str]:
    """The decision of the coordinator at ``coordinator`` for ``epoch``, asked as the node
    whose agent is ``identity``; or None and why it could not be asked (the module
    docstring's deadlines)."""
    try:
        answer = await ask(identity, coordinator, DecisionQuery(epoch), keyring=keyring,
                           channel=ASSIGNMENT_CHANNEL, answers={Decision.T: MessageSpec()},
                           connect_s=CONNECT_S, answer_s=FRAME_S,
                           close_reason="query answered")
        return Decision.from_wire(answer.header).decision, ""
    except MessageError as exc:
        log.warning("stage assignment %d: coordinator %s answered out of bounds: %s", epoch,
                    coordinator, exc)
        return None, f"no answer: {exc}"
    except AskFailed as exc:
        if exc.kind == "address":  # not host:port: nothing to dial
            return None, f"coordinator address {coordinator!r} {exc.message}"
        if exc.kind == "connect":
            log.warning("stage assignment %d: cannot ask coordinator %s: %s", epoch,
                        coordinator, exc.message)
            return None, exc.message
        log.warning("stage assignment %d: coordinator %s did not answer: %s", epoch,
                    coordinator, exc.message)
        return None, f"no answer: {exc.message}"


def serve_queries(agent: AgentService, plans: Plans, asked: Asked | None = None) -> None:
    """Answer a peer's ``query`` from the plans table (an undecided plan reads as abort);
    ``asked`` then hears the epoch and the answer (``Coordinator.peer_asked``)."""

    async def answer(stream: MxclStream, env: Envelope) -> None:
        epoch = epoch_of(env.header)
        row = plans.get(epoch) if epoch is not None else None
        decision = "unknown" if row is None else (row.decision or "abort")
        await stream.send(sent(Decision(epoch or 0, decision)))
        if asked is not None and row is not None:
            asked(row.epoch, decision)

    agent.add_handler(ASSIGNMENT_CHANNEL, DecisionQuery.T, answer)
