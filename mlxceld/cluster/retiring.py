"""Make before break, its end: the old plan's hosts are told it is over once the router's
engine of it closed.

A re-plan (a heal, a drain's re-plan, an operator's re-activate over a plan served) moves
the router to the new plan live: its running sequences end on the old plan's stages,
which the hosts kept serving meanwhile (``assignment/stagehost.py``: ``stage-retiring``).
``retire`` waits for the router to close that old engine (``closed``: the coordinator's
``old_plan_retired``, bounded by ``coordinator.RETIRED_WAIT_S``), then tells ``hosts``
that the old plan is over (``deactivation.tell``, once: a host that does not answer asks
when its daemon restarts), so the stage each kept stops. The coordinator tells every host
of the old plan (``Coordinator``); self-healing only those the new plan kept, the others
being fenced after it (``healer.py``). Each caller says what came of it in its own words.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from mlxceld.cluster.assignment import deactivation
from mlxceld.wire import Keyring


@dataclass(frozen=True)
class Retired:
    """What ``retire`` did: whether the router's old engine closed in time (else it was
    given up on), and each host's answer."""

    closed: bool
    told: Mapping[str, deactivation.Outcome]

    def said(self) -> str:
        """Each host's answer, for a log line: ``host: state, ...`` (empty: none told)."""
        return ", ".join(f"{a}: {state}" for a, (state, _) in sorted(self.told.items()))


async def retire(old_epoch: int, hosts: Sequence[str], new_epoch: int, *,
                 closed: Callable[[], Awaitable[bool]], keyring: Keyring,
                 identity: str) -> Retired:
    """Once ``closed()`` returns (the router's engine of plan ``old_epoch`` closed, or its
    bound passed), tell ``hosts`` that plan ``old_epoch`` is over: plan ``new_epoch``
    serves in its place."""
    was_closed = await closed()
    told = await deactivation.tell(old_epoch, hosts, keyring=keyring, identity=identity,
                                   reason=f"plan {new_epoch} serves in its place") \
        if hosts else {}
    return Retired(was_closed, told)
