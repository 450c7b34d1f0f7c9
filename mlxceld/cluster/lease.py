"""A stage host's lease on its plan's coordinator, and a standby's reading of it.

A standby coordinator (``daemon/standby.py``) judges its coordinator gone by its own asks
(``daemon/following.py``). Cut off from the coordinator alone (the coordinator alive and
reaching its stage hosts), it would take over while the coordinator still heals and
drains: two coordinators acting at once, the newer epoch winning each push. The lease
closes that gap where the two coordinators meet, at the stage hosts:

- **Who holds it.** On a stage host, the coordinator that offered the newest plan it holds
  a stage of (``Assignments.holding``: preparing, accepted, committed or active), for that
  plan's epoch. No stage held (none yet, or deactivated, aborted): no lease.
- **Heard.** The coordinator's daemon dials its plan's peers all along (its failure
  detector's heartbeats, ``discovery/heartbeat.py``: a ping every ``peer_ping_interval_s``;
  its inventory polls, offers and decisions too). The agent listener keeps when each
  identity last sent anything (``AgentService.last_heard``); the holder's is the lease's.
  It is the coordinator's *daemon* that is heard (healing and drains are its acts); its
  router worker's traffic to the stage workers does not count.
- **Length.** ``[daemon] peer_dead_after_s`` of the stage host (default 10 s): a
  coordinator silent that long is what the failure detector calls dead, the same bound
  after which a coordinator heals a silent stage host and a standby calls its coordinator
  gone. With the heartbeats' ping interval (0.5 s by default) well inside it, a live
  coordinator renews its lease many times per period.
- **A restart** of the stage host: the lease counts as heard at the daemon's start
  (``started``) if it was not heard since: live for one period from the start,
  conservatively (the host cannot know what it missed while down).
- **Kept.** The lease (holder, epoch, when last heard, length) is written to the settings
  table (``KEPT``) when its holder or epoch changes and at least every half period while
  it is asked about: what an operator finds in ``state.db``.

What it holds back (``refusal``): an ``offer`` (channel 2, ``assignment/peer.py``) from
any identity other than the holder, while the lease runs, is refused with code ``lease``
before a round starts (nothing recorded, nothing loaded: the pushing coordinator aborts
its plan), naming the holder and how long the lease still runs. The holder's own offers,
and every offer once the lease expired (or its plan was deactivated), are judged as before
(the epoch decides). Decisions of a round already on, deactivations and every channel-3
question are not held back.

How a standby reads it: the ``assignment`` answer (``cluster/fencing.py``) carries the
lease's holder, epoch, ``heard_s`` and ``lease_s``; ``still_heard`` asks each stage host of
the plan followed (all at once, each within ``ASK_CONNECT_S + ASK_ANSWER_S``) and says why
a takeover waits: a lease still running (``StillHeard``), a stage host not answering, or
one holding a plan newer than the one followed (the coordinator re-planned while this
standby could not hear it: it would adopt a stale plan).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from mlxceld.cluster.assignment.peer_round import HOLDS_A_STAGE
from mlxceld.cluster.fencing import ask_assignment
from mlxceld.net.resolve import Resolver
from mlxceld.state import Settings
from mlxceld.state.plans import Assignments
from mlxceld.wire import SecretStore
from mlxceld.wire.address import HostPort
from mlxceld.wire.agent_messages import Assignment

log = logging.getLogger(__name__)

KEPT: Final = "assignment.lease"  # the settings key of the lease, as last written
ASK_CONNECT_S: Final = 2.0  # a standby's lease question to a stage host it sees alive
ASK_ANSWER_S: Final = 2.0


@dataclass(frozen=True)
class Held:
    """The lease: ``holder`` (its agent address) of plan ``epoch``, last heard at
    ``heard_at`` (wall clock), for ``length_s`` from then."""

    holder: str
    epoch: int
    heard_at: float
    length_s: float

    def heard_s(self, now: float) -> float:
        return max(now - self.heard_at, 0.0)

    def left_s(self, now: float) -> float:
        return max(self.heard_at + self.length_s - now, 0.0)


class Lease:
    """A stage host's lease (the module docstring)."""

    def __init__(self, assignments: Assignments, settings: Settings, *,
                 heard: Callable[[], Mapping[HostPort, float]],
                 length_s: Callable[[], float]) -> None:
        """``heard``: ``AgentService.last_heard``; ``length_s``: the dead time."""
        self._assignments = assignments
        self._settings = settings
        self._heard = heard
        self._length_s = length_s
        self._resolver = Resolver()
        self.started = time.time()
        self._kept = settings.get(KEPT)
        if isinstance(self._kept, dict):
            log.info("lease kept before the restart: %s (taken as heard at this start)",
                     self._kept)

    async def current(self) -> Held | None:
        """The lease now, run out or not; None with no stage held."""
        row = self._assignments.holding([str(s) for s in HOLDS_A_STAGE])
        if row is None:
            return None
        heard = [at for who, at in self._heard().items()
                 if await self._resolver.is_node(row.coordinator, who)]
        held = Held(row.coordinator, row.epoch, max([self.started, *heard]),
                    self._length_s())
        self._keep(held)
        return held

    async def refusal(self, bound: HostPort, epoch: int) -> str | None:
        """Why an offer of plan ``epoch`` from ``bound`` is refused (None: not for the
        lease's sake)."""
        held = await self.current()
        now = time.time()
        if held is None or held.left_s(now) <= 0 or await self._resolver.is_node(
                held.holder, bound):
            return None
        return (f"plan {epoch} from {bound} refused: coordinator {held.holder} holds this "
                f"host's lease (plan {held.epoch}, heard {held.heard_s(now):.1f} s ago); "
                f"it runs {held.left_s(now):.1f} s more unless that coordinator is heard "
                "again (deactivate its plan there, or stop it, to hand over)")

    async def answer(self, row: tuple[int, str, str] | None) -> Assignment:
        """The ``assignment`` answer: ``row`` (the newest assignment's epoch, coordinator
        and state) and the lease."""
        held, now = await self.current(), time.time()
        epoch, coordinator, state = row if row is not None else (None, None, None)
        if held is None:
            return Assignment(epoch, coordinator, state)
        return Assignment(epoch, coordinator, state, held.holder, held.epoch,
                          round(held.heard_s(now), 3), round(held.left_s(now), 3))

    def _keep(self, held: Held) -> None:
        kept = self._kept if isinstance(self._kept, dict) else {}
        if (kept.get("holder"), kept.get("epoch")) == (held.holder, held.epoch) and \
                held.heard_at - float(kept.get("heard_at") or 0) < held.length_s / 2:
            return
        self._kept = {"holder": held.holder, "epoch": held.epoch, "heard_at": held.heard_at,
                      "length_s": held.length_s}
        self._settings.put(KEPT, self._kept)


@dataclass(frozen=True)
class StillHeard:
    """A takeover held back: stage host ``peer`` heard coordinator ``holder`` ``heard_s``
    ago, and its lease runs ``lease_s`` more."""

    peer: str
    holder: str
    heard_s: float
    lease_s: float

    @property
    def summary(self) -> str:
        return (f"coordinator unreachable from here but heard by stage peers "
                f"{self.heard_s:.1f} s ago (coordinator {self.holder}, by {self.peer}; its "
                f"lease runs {self.lease_s:.1f} s more); not taking over")


async def still_heard(peers: Sequence[str], followed: int, *, identity: str,
                      keyring: SecretStore) -> StillHeard | str | None:
    """Whether the stage hosts ``peers`` of plan ``followed`` hold a takeover back: a
    lease of another coordinator still running (the freshest), a host not asked, or one
    holding a newer plan than ``followed``; None when none does."""
    answers = await asyncio.gather(*(ask_assignment(
        identity, p, keyring=keyring, connect_s=ASK_CONNECT_S, answer_s=ASK_ANSWER_S)
        for p in peers))
    live: list[StillHeard] = []
    for peer, a in zip(peers, answers, strict=True):
        if a is None:
            return f"stage host {peer} not asked about its lease (see the log)"
        if a.held is not None and a.held > followed:
            return (f"stage host {peer} holds plan {a.held} of coordinator {a.holder}, "
                    f"newer than plan {followed} followed here: not taking over a plan "
                    "this router does not know (it follows the coordinator again once "
                    "it answers)")
        if a.holder is not None and a.holder != identity and (a.lease_s or 0) > 0:
            live.append(StillHeard(peer, a.holder, a.heard_s or 0.0, a.lease_s or 0.0))
    return min(live, key=lambda s: s.heard_s) if live else None
