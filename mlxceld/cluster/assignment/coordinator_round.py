"""The two-phase stage assignment, sans-IO: the coordinator's round (a peer's is
``peer_round``).

No sockets, no clock, no SQLite: inputs are messages, connection losses and
``now``; outputs are ``Action``s the shell carries out *in order* (a ``Persist``
must be durable before the ``Send`` after it goes out).

The coordinator (one ``CoordinatorRound`` per plan epoch)::

    OFFERING  --every peer accepted-->  Persist(commit), Send(commit)  COMMITTING
    COMMITTING --every peer committed--> Persist(activate), Send(activate) ACTIVATING
    ACTIVATING --every peer active-->    Persist(active)                 DONE
    OFFERING or COMMITTING --a refusal, a lost peer, a deadline-->
                                         Persist(abort), Send(abort)     ABORTED

The whole machine is ``COORDINATOR_TABLE``, at the end: (phase, event) ->
(handler, the phases it may lead to). Each ``on_*`` method makes its event and
looks it up; a pair not listed is ignored: the method returns ``[]`` and changes
nothing (a late, resent or out-of-phase message), and so is a message about a
peer that is not the round's. A peer's failure after the decision is noted for
``progress()``, nothing more. A ``preparing`` heartbeat (``on_preparing``) is
noted in any phase and moves none: it is not in the table.

Deadlines: offers until ``start + push_s - commit_window_s`` (a peer's
``preparing`` heartbeat, sent while it loads its weights, moves its own
deadline to ``heartbeat + frame_s``); the commit phase ``commit_window_s``; once
``activate`` is persisted the decision is final: activation is re-sent until
every peer is active (every ``RESEND_S``), even by a coordinator that restarted.

A peer (``PeerRound``, in ``peer_round.py``, its names exported here too)
persists its vote before it sends it and follows the coordinator's decisions;
every message carries the epoch, and anything about another epoch is ignored.
An offer of another plan while a round is on (``PeerRound.on_other_offer``): an
older or equal epoch is refused as stale; a newer one that checks out
supersedes an undecided round (preparing, accepted: its stage stops, it is
recorded aborted and its coordinator told) and starts its own; a committed round
is decided, so the newer offer is refused as busy until it ends (active, or
aborted after its deadline).

After the round, the coordinator may end the plan (``PeerRound.on_deactivate``,
`mlxctl cluster deactivate`, ``deactivation.py``): from any state the stage
stops and the round is recorded deactivated, which a restart does not resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Literal

from mlxceld.cluster.assignment.peer_round import FRAME_S  # one answer (either side's)

PUSH_S: Final = 60.0  # the coordinator's whole push
COMMIT_WINDOW_S: Final = 10.0  # always left for the commit phase
RESEND_S: Final = 2.0  # activation re-sent this often until every peer is active

Decision = Literal["commit", "activate", "active", "abort"]


@dataclass(frozen=True)
class Send:
    peer: str
    kind: str  # offer | commit | activate | abort
    summary: str = ""


@dataclass(frozen=True)
class Persist:
    decision: Decision
    summary: str = ""


@dataclass(frozen=True)
class Finished:
    ok: bool
    summary: str  # for the operator: each peer that failed, and why


Action = Send | Persist | Finished


class Phase(StrEnum):
    """The coordinator's round. Not stored: the plans table keeps its ``Decision``s."""

    OFFERING = "offering"
    COMMITTING = "committing"
    ACTIVATING = "activating"
    DONE = "done"
    ABORTED = "aborted"


# -- the coordinator's events: its ``on_*`` methods make them, ``COORDINATOR_TABLE`` routes them


@dataclass(frozen=True)
class _FromPeer:
    peer: str
    now: float


class PeerAccepted(_FromPeer):
    """``accepted``: the peer's vote, once its stage runs in standby."""


class PeerCommitted(_FromPeer): ...


class PeerActivated(_FromPeer): ...


@dataclass(frozen=True)
class PeerFailed:
    """A refusal, a lost connection, a peer that could not be reached, its ``aborted``."""

    peer: str
    reason: str


@dataclass(frozen=True)
class TimerFired:
    """``next_deadline()`` has passed."""

    now: float


CoordinatorEvent = PeerAccepted | PeerCommitted | PeerActivated | PeerFailed


@dataclass
class CoordinatorRound:
    """One plan epoch, the coordinator's side: see the module docstring and
    ``COORDINATOR_TABLE``."""

    epoch: int
    peers: tuple[str, ...]
    started: float
    push_s: float = PUSH_S
    commit_window_s: float = COMMIT_WINDOW_S
    frame_s: float = FRAME_S
    phase: Phase = Phase.OFFERING
    accepted: set[str] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)
    failures: dict[str, str] = field(default_factory=dict)
    _heard: dict[str, float] = field(default_factory=dict)
    _phase_deadline: float = 0.0
    _resend_at: float = 0.0

    def start(self) -> list[Action]:
        """Open a new round: the offers."""
        self._phase_deadline = self.started + self.push_s - self.commit_window_s
        return self._send("offer")

    @classmethod
    def resume(cls, epoch: int, peers: tuple[str, ...], decision: Decision | None,
               now: float) -> tuple[CoordinatorRound, list[Action]]:
        """After a restart: an undecided plan is presumed aborted; a commit decision re-runs
        the commit phase (commit is idempotent); an activate decision re-sends activate."""
        r = cls(epoch, peers, now)
        if decision is None:
            return r, r._abort("the coordinator restarted before deciding")
        if decision == "commit":
            r.phase, r.accepted = Phase.COMMITTING, set(peers)
            r._phase_deadline = now + r.commit_window_s
            return r, r._send("commit")
        if decision == "activate":
            r.phase, r.accepted, r.committed = Phase.ACTIVATING, set(peers), set(peers)
            r._resend_at = now + RESEND_S
            return r, r._send("activate")
        r.phase = Phase.DONE if decision == "active" else Phase.ABORTED
        return r, []

    # -- inputs: each is an event for COORDINATOR_TABLE ------------------------------------

    def on_preparing(self, peer: str, now: float) -> list[Action]:
        """A heartbeat while the peer loads its weights: its offer deadline moves on. Noted
        in any phase, and it moves none: not an event for the table."""
        self._heard[peer] = now
        return []

    def on_accepted(self, peer: str, now: float) -> list[Action]:
        return self._handle(PeerAccepted(peer, now))

    def on_committed(self, peer: str, now: float) -> list[Action]:
        return self._handle(PeerCommitted(peer, now))

    def on_active(self, peer: str, now: float) -> list[Action]:
        return self._handle(PeerActivated(peer, now))

    def on_refused(self, peer: str, reason: str) -> list[Action]:
        return self.on_failed(peer, f"refused: {reason}")

    def on_failed(self, peer: str, reason: str) -> list[Action]:
        """A refusal, a lost connection, a peer that could not be reached."""
        return self._handle(PeerFailed(peer, reason))

    def handle_timer(self, now: float) -> list[Action]:
        """Fire the phase's timer if ``next_deadline()`` has passed; else do nothing."""
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return []
        return self._dispatch(TimerFired(now))

    def progress(self) -> dict[str, tuple[str, str]]:
        """Each peer's (state, reason), for the operator: offered, loading (its offer
        checked out; it loads the stage), prepared, committed, active, failed, aborted."""
        out: dict[str, tuple[str, str]] = {}
        for p in self.peers:
            if p in self.failures:
                out[p] = ("failed", self.failures[p])
            elif p in self.active:
                out[p] = ("active", "")
            elif self.phase is Phase.ABORTED:
                out[p] = ("aborted", "another peer failed")
            elif p in self.committed:
                out[p] = ("committed", "")
            elif p in self.accepted:
                out[p] = ("prepared", "")
            else:
                out[p] = ("loading" if p in self._heard else "offered", "")
        return out

    def next_deadline(self) -> float | None:
        if self.phase is Phase.OFFERING:
            waiting = [self._offer_deadline(p) for p in self.peers if p not in self.accepted]
            return min(waiting) if waiting else None
        if self.phase is Phase.COMMITTING:
            return self._phase_deadline
        if self.phase is Phase.ACTIVATING:
            return self._resend_at
        return None

    def _handle(self, event: CoordinatorEvent) -> list[Action]:
        """A message (or its loss) about one peer: one not in this round is ignored."""
        return self._dispatch(event) if event.peer in self.peers else []

    def _dispatch(self, event: CoordinatorEvent | TimerFired) -> list[Action]:
        row = COORDINATOR_TABLE.get((self.phase, type(event)))
        return [] if row is None else row[0](self, event)

    # -- handlers: one per row of COORDINATOR_TABLE -----------------------------------------

    def _on_accepted(self, e: PeerAccepted) -> list[Action]:
        self.accepted.add(e.peer)
        if self.accepted != set(self.peers):
            return []
        self.phase, self._phase_deadline = Phase.COMMITTING, e.now + self.commit_window_s
        return [Persist("commit"), *self._send("commit")]

    def _on_committed(self, e: PeerCommitted) -> list[Action]:
        self.committed.add(e.peer)
        if self.committed != set(self.peers):
            return []
        self.phase, self._resend_at = Phase.ACTIVATING, e.now + RESEND_S
        return [Persist("activate"), *self._send("activate")]

    def _on_activated(self, e: PeerActivated) -> list[Action]:
        self.active.add(e.peer)
        if self.active != set(self.peers):
            return []
        self.phase = Phase.DONE
        return [Persist("active"), Finished(True, f"plan {self.epoch}: every stage of "
                                                  f"{len(self.peers)} is active")]

    def _on_failed(self, e: PeerFailed) -> list[Action]:
        self.failures.setdefault(e.peer, e.reason)
        return self._abort(self._summary())

    def _on_failed_when_decided(self, e: PeerFailed) -> list[Action]:
        self.failures.setdefault(e.peer, e.reason)  # for progress(); the decision stands
        return []

    def _on_offers_late(self, e: TimerFired) -> list[Action]:
        for p in self.peers:
            if p not in self.accepted and e.now >= self._offer_deadline(p):
                self.failures.setdefault(p, "did not accept in time")
        return self._abort(self._summary())

    def _on_commit_window_closed(self, e: TimerFired) -> list[Action]:
        for p in self.peers:
            if p not in self.committed:
                self.failures.setdefault(p, f"did not commit within "
                                            f"{self.commit_window_s:g} s")
        return self._abort(self._summary())

    def _on_resend(self, e: TimerFired) -> list[Action]:
        self._resend_at = e.now + RESEND_S
        return [Send(p, "activate") for p in self.peers if p not in self.active]

    # -- helpers --------------------------------------------------------------------------

    def _send(self, kind: str) -> list[Action]:
        return [Send(p, kind) for p in self.peers]

    def _offer_deadline(self, peer: str) -> float:
        return max(self._phase_deadline, self._heard.get(peer, 0.0) + self.frame_s)

    def _abort(self, summary: str) -> list[Action]:
        self.phase = Phase.ABORTED
        return [Persist("abort", summary), *(Send(p, "abort", summary) for p in self.peers),
                Finished(False, summary)]

    def _summary(self) -> str:
        did_not = [p for p in self.peers if p not in self.committed]
        parts = [f"{p}: {self.failures.get(p, 'aborted because another peer failed')}"
                 for p in did_not]
        return f"plan {self.epoch} aborted; peers that did not commit: " + "; ".join(parts)


_CRow = tuple[Callable[[CoordinatorRound, Any], list[Action]], tuple[Phase, ...]]
_P = Phase

# (phase, event) -> (handler, the phases it may lead to). A pair not listed is ignored: the
# method returns [] and changes nothing (a late, resent or out-of-phase message). A
# TimerFired comes only once next_deadline() has passed: a phase without one has no timer.
COORDINATOR_TABLE: Final[dict[tuple[Phase, type[object]], _CRow]] = {
    (_P.OFFERING, PeerAccepted): (CoordinatorRound._on_accepted, (_P.OFFERING, _P.COMMITTING)),
    (_P.OFFERING, PeerFailed): (CoordinatorRound._on_failed, (_P.ABORTED,)),
    (_P.OFFERING, TimerFired): (CoordinatorRound._on_offers_late, (_P.ABORTED,)),
    (_P.COMMITTING, PeerCommitted): (CoordinatorRound._on_committed,
                                     (_P.COMMITTING, _P.ACTIVATING)),
    (_P.COMMITTING, PeerFailed): (CoordinatorRound._on_failed, (_P.ABORTED,)),
    (_P.COMMITTING, TimerFired): (CoordinatorRound._on_commit_window_closed, (_P.ABORTED,)),
    (_P.ACTIVATING, PeerActivated): (CoordinatorRound._on_activated,
                                     (_P.ACTIVATING, _P.DONE)),
    (_P.ACTIVATING, PeerFailed): (CoordinatorRound._on_failed_when_decided, (_P.ACTIVATING,)),
    (_P.ACTIVATING, TimerFired): (CoordinatorRound._on_resend, (_P.ACTIVATING,)),
    (_P.DONE, PeerFailed): (CoordinatorRound._on_failed_when_decided, (_P.DONE,)),
    (_P.ABORTED, PeerFailed): (CoordinatorRound._on_failed_when_decided, (_P.ABORTED,)),
}
