"""Ending a plan: the coordinator's side of `mlxctl cluster deactivate` (channel 2).

The coordinator first records the plan as deactivated (``Plans.decide``), so that
neither its own restart nor a peer's brings it back; then it stops its router and
tells every peer of the plan at once (``tell``): one connection each to the
peer's agent listener, ``deactivate``, and the peer's ``deactivated`` once its
stage worker is stopped and its assignment recorded deactivated
(``peer.Assignee``; the messages are listed in ``push.py``). Each peer
ends ``deactivated``, ``unreachable`` (no connection, or no answer in time: the
reason) or ``refused`` (the peer's code and reason).

A peer that was not told learns it later, whichever comes first:

- the coordinator tries it again every ``RETRY_S`` for ``RETRY_FOR_S`` while
  it runs (``chase``);
- the peer's daemon, restarting with the assignment active, asks the
  coordinator before it brings the stage back, and hears ``deactivated``;
- `mlxctl cluster deactivate` again tells every peer of the plan again.

Until then its stage worker keeps its memory but serves nobody: it takes
requests only from the plan's routers, and the coordinator's no longer runs (a router
in front of the pipeline stops once the coordinator has said "no plan" for 10 s:
``daemon/following.py``).

Bounds: ``CONNECT_S`` per dial and handshake; ``ANSWER_S`` for the answer, as
the peer stops its stage worker first (its stop timeout is at most 20 s unless
configured longer, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Final

from mlxceld.cluster.assignment.push import (
    ASSIGNMENT_CHANNEL,
    CONNECT_S,
    COORDINATOR_SPECS,
    epoch_of,
)
from mlxceld.net.agent import ask
from mlxceld.net.errors import AskFailed
from mlxceld.wire import Keyring
from mlxceld.wire.assignment_messages import Deactivate, Deactivated, Refused
from mlxceld.wire.messages import MessageError

log = logging.getLogger(__name__)

ANSWER_S: Final = 30.0  # a peer's answer: it stops its stage worker first
RETRY_S: Final = 20.0  # between two tries at the peers not told yet
RETRY_FOR_S: Final = 3600.0  # how long they are tried again

Outcome = tuple[str, str]  # (deactivated | unreachable | refused, reason)
Told = Callable[[str, Outcome], None]  # a peer told late, and what it answered


async def tell(epoch: int, peers: Sequence[str], *, keyring: Keyring, identity: str,
               reason: str) -> dict[str, Outcome]:
    """Send ``deactivate`` to every peer (their agent addresses) at once; each outcome."""
    outcomes = await asyncio.gather(*(_tell(epoch, p, keyring, identity, reason)
                                      for p in peers))
    return dict(zip(peers, outcomes, strict=True))


async def chase(epoch: int, peers: Sequence[str], told: Told, *, keyring: Keyring,
                identity: str, reason: str) -> None:
    """Tell ``peers`` again every ``RETRY_S`` until each has answered ``deactivated`` (then
    ``told`` hears it), for ``RETRY_FOR_S`` at most."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + RETRY_FOR_S
    left = list(peers)
    while left and loop.time() + RETRY_S < give_up:
        await asyncio.sleep(RETRY_S)
        outcomes = await tell(epoch, left, keyring=keyring, identity=identity, reason=reason)
        for peer, outcome in outcomes.items():
            if outcome[0] == "deactivated":
                left.remove(peer)
                told(peer, outcome)
    if left:
        log.warning("plan %d: %s not told of the deactivation after %g s; each learns it "
                    "when its daemon restarts, or run mlxctl cluster deactivate again", epoch,
                    ", ".join(left), RETRY_FOR_S)


async def _tell(epoch: int, agent: str, keyring: Keyring, identity: str,
                reason: str) -> Outcome:
    try:
        answer = await ask(identity, agent, Deactivate(epoch, reason),
                           keyring=keyring, channel=ASSIGNMENT_CHANNEL,
                           answers=COORDINATOR_SPECS, connect_s=CONNECT_S, answer_s=ANSWER_S,
                           wanted=lambda env: epoch_of(env.header) == epoch
                           and env.type in (Deactivated.T, Refused.T),
                           close_reason="deactivation over")
    except AskFailed as exc:
        if exc.kind in ("connect", "address"):
            return "unreachable", f"cannot connect: {exc.message}"
        if exc.kind == "error":
            return "refused", f"protocol error: {exc.detail}"
        if exc.kind == "timeout":
            return "unreachable", f"no answer within {ANSWER_S:g} s"
        return "unreachable", f"connection lost: {exc.message}"
    try:
        if answer.type == Deactivated.T:
            return "deactivated", Deactivated.from_wire(answer.header).reason
        refused = Refused.from_wire(answer.header)
    except MessageError as exc:
        return "unreachable", f"bad answer: {exc}"
    return "refused", f"{refused.code}: {refused.reason}"
