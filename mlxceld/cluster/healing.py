"""Self-healing's decisions, sans-IO: when a served plan is healed around a dead host or
re-planned around a drained one, in how many stages, when a heal that could not be done
is tried again, and which superseded hosts are fenced.

No IO and no clock of its own (as ``discovery/detector.py``): the shell (``healer.py``)
hands each look a ``View`` (the plan this coordinator serves, the failure detector's
verdicts, discovery's candidates, whether the operator's bring-up or deactivation runs)
and the wall time, and carries out what comes back::

    no plan served, the operator busy .............................. Idle
    a stage host drained (`mlxctl drain`) ........................... Replan(alive)
    off (heal_after_s = 0) ......................................... Idle
    a stage host dead, since S, and now < S + heal_after_s .......... Waiting(due)
    a stage host dead past its grace ................................ Heal(alive)
    ... but the last heal or re-plan of this plan was refused over
        these same alive hosts (or failed less than heal_after_s ago)  Held

A heal plans over the hosts the detector holds ``alive`` (the plan's own and every
other candidate: spares), never one that is suspect, dead, unknown or drained. A
refusal (the model does not fit) is tried again only when that set changes (a host
comes back, a spare appears, one more dies); a push that failed, also after
``heal_after_s``. A host that answers again before its grace ends is simply back:
nothing is re-planned.

A drain is the operator's word, so it is re-planned around whether self-healing is on
or off: a host of the served plan that is drained (``View.drained``: agent addresses)
is planned around at once, over the hosts alive and not drained; the drain itself
goes on as without a plan (refuse, finish, deadline) when that plan does not fit.

Once a plan ``E + 1`` replaced ``E``, each host of ``E`` left out of ``E + 1`` still
runs ``E``'s stage, or will once it is awake again: it is to be fenced (``to_fence``),
i.e. told that ``E`` is over, as soon as the detector holds it alive, until it
answered (``fenced``). It is a candidate like any other for the next plan, and is not
pulled into the running one. A fence that did not get through (``fence_failed``: the host
alive to the detector, yet its agent did not answer the deactivation) is tried again
after a backoff, ``FENCE_RETRY_S`` (1 s) doubled at each failure up to
``FENCE_RETRY_MAX_S`` (30 s), not at every look; a fence that gets through forgets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from mlxceld.state.liveness import LivenessState
from mlxceld.state.plans import Plans

FENCE_RETRY_S: Final = 1.0  # the wait after a fence's first failure, doubled at each next
FENCE_RETRY_MAX_S: Final = 30.0  # the longest wait between two tries of a fence
REPLAN_RETRY_S = 60.0  # a drain's re-plan whose push failed, with heal_after_s = 0: again after


def stage_count(served: int, hosts: int) -> int:
    """The stages of a heal's (or a drain's re-plan's) plan: as many as the ``served``
    plan has, or as many as there are ``hosts`` to plan over if fewer (one host of two
    left: the whole model on it, if it fits); a spare never adds a stage."""
    return max(1, min(served, hosts))


@dataclass(frozen=True)
class View:
    """What the shell sees at one look."""

    epoch: int | None  # the plan served from here; None: none
    peers: tuple[str, ...]  # its stage hosts' agent addresses
    liveness: Mapping[str, tuple[LivenessState, float]]  # address -> (state, since: unix)
    candidates: frozenset[str]  # discovery's candidates, spares included
    busy: bool = False  # a bring-up or a deactivation runs: the operator wins
    drained: frozenset[str] = frozenset()  # agent addresses of drained nodes (mlxctl drain)

    def alive(self) -> tuple[str, ...]:
        """The hosts to plan over: alive, and not drained."""
        return tuple(sorted(a for a in self.candidates | set(self.peers)
                            if self.liveness.get(a, ("unknown", 0.0))[0] == "alive"
                            and a not in self.drained))

    def drained_peers(self) -> tuple[str, ...]:
        """The plan's hosts that are drained."""
        return tuple(sorted(p for p in self.peers if p in self.drained))

    def dead(self) -> dict[str, float]:
        """The plan's hosts held dead, and since when."""
        return {p: since for p in self.peers
                if (row := self.liveness.get(p)) is not None and row[0] == "dead"
                for since in (row[1],)}


@dataclass(frozen=True)
class Idle:
    reason: str


@dataclass(frozen=True)
class Waiting:
    epoch: int
    dead: tuple[str, ...]
    due: float  # unix time the grace ends


@dataclass(frozen=True)
class Held:
    epoch: int
    dead: tuple[str, ...]
    reason: str  # why the last try did not heal, and what would make the next one


@dataclass(frozen=True)
class Heal:
    epoch: int  # the plan to replace
    dead: tuple[str, ...]
    alive: tuple[str, ...]  # whom to plan over


@dataclass(frozen=True)
class Replan:
    epoch: int  # the plan to replace
    drained: tuple[str, ...]  # its hosts drained
    alive: tuple[str, ...]  # whom to plan over


Decision = Idle | Waiting | Held | Heal | Replan


@dataclass
class _Blocked:
    epoch: int
    alive: tuple[str, ...]
    reason: str
    retry_at: float | None  # None: only when ``alive`` changes


@dataclass
class Healing:
    heal_after_s: float
    _blocked: _Blocked | None = None
    _fence: dict[str, int] = field(default_factory=dict)  # address -> the epoch it runs
    # address -> (the time of its next try, the wait after its last failure)
    _fence_retry: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.heal_after_s > 0

    def decide(self, view: View, now: float) -> Decision:
        if view.epoch is None:
            return Idle("no plan is served from here")
        if view.busy:
            return Idle("a bring-up or a deactivation is in progress: it goes first")
        drained = view.drained_peers()
        if drained:
            return self._held(view, drained, now) or Replan(view.epoch, drained, view.alive())
        if not self.enabled:
            return Idle("self-healing is off (heal_after_s = 0)")
        dead = view.dead()
        if not dead:
            return Idle(f"every stage host of plan {view.epoch} is up")
        names = tuple(sorted(dead))
        due = min(dead.values()) + self.heal_after_s
        if now < due:
            return Waiting(view.epoch, names, due)
        return self._held(view, names, now) or Heal(view.epoch, names, view.alive())

    def _held(self, view: View, names: tuple[str, ...], now: float) -> Held | None:
        """Held, if the last try on this plan was over the same hosts alive."""
        b = self._blocked
        if (b is not None and b.epoch == view.epoch and b.alive == view.alive()
                and (b.retry_at is None or now < b.retry_at)):
            return Held(view.epoch, names, b.reason)
        return None

    def refused(self, heal: Heal | Replan, reason: str) -> None:
        """The plan over ``heal.alive`` does not fit: wait until that set changes."""
        self._blocked = _Blocked(heal.epoch, heal.alive, reason + "; tried again when a host "
                                 "comes back or another candidate is alive", None)

    def failed(self, heal: Heal | Replan, reason: str, now: float) -> None:
        """The push did not end active: again after ``heal_after_s`` (``REPLAN_RETRY_S``
        for a drain's re-plan while self-healing is off), or on a change."""
        wait = self.heal_after_s or REPLAN_RETRY_S
        self._blocked = _Blocked(heal.epoch, heal.alive, reason + f"; tried again in "
                                 f"{wait:g} s or when the hosts alive change", now + wait)

    def healed(self, old_epoch: int, old_peers: tuple[str, ...],
               new_peers: tuple[str, ...]) -> None:
        """Plan ``old_epoch`` is replaced: its hosts left out are to be fenced."""
        self._blocked = None
        for peer in old_peers:
            if peer not in new_peers:
                self._fence[peer] = old_epoch
        for peer in new_peers:  # a host of the new plan runs the new plan's stage
            self._fence.pop(peer, None)
            self._fence_retry.pop(peer, None)

    def to_fence(self, view: View, now: float) -> list[tuple[str, int]]:
        """Superseded hosts alive now and due (past their backoff), each with the epoch to
        end there."""
        return [(a, e) for a, e in sorted(self._fence.items())
                if view.liveness.get(a, ("unknown", 0.0))[0] == "alive"
                and self._fence_retry.get(a, (now, 0.0))[0] <= now]

    def fenced(self, address: str) -> None:
        self._fence.pop(address, None)
        self._fence_retry.pop(address, None)

    def fence_failed(self, address: str, now: float) -> float:
        """A fence of ``address`` did not get through: the seconds until its next try."""
        last = self._fence_retry.get(address, (now, 0.0))[1]
        wait = min(FENCE_RETRY_MAX_S, last * 2) if last else FENCE_RETRY_S
        self._fence_retry[address] = (now + wait, wait)
        return wait

    def unfenced(self) -> dict[str, int]:
        return dict(self._fence)


def resumed(plans: Plans, heal_after_s: float) -> Healing:
    """Self-healing's decisions at a daemon's start, with the hosts of the plans the latest
    one superseded (a heal, a drain's re-plan) to fence again: a restart may have come
    before they were told; telling one twice is harmless."""
    healing = Healing(heal_after_s)
    last = plans.resumable()  # not an aborted push after it
    if last is not None:
        for old in plans.superseded_by(last.epoch):
            healing.healed(old.epoch, old.peers, last.peers)
    return healing
