"""The two-phase stage assignment, sans-IO: the coordinator's round (a peer's is
``peer_round``).

No sockets, no clock, no SQLite: inputs are messages, connection losses and
``now``; outputs are ``Action``s the shell carries out *in order* (a ``Persist``
must be durable before the ``Send`` after it goes out).

The coordinator (one ``CoordinatorRound`` per plan epoch)::

    OFFERING  --every peer accepted-->  Persist(commit), Send(commit)  COMMITTING
    COMMITTING --every peer committed--> Persist(activate), Send(activate) ACTIVATING
    ACTIVATING --every peer active-->    Persist(active)                 DONE
    OFFERING or COMMITTING --a refusal, an abort, a deadline-->
                                         Persist(abort), Send(abort)     ABORTED
    OFFERING --a lost peer (its vote cannot be asked again)--> the same  ABORTED
    COMMITTING/ACTIVATING --a lost peer--> noted unreachable             the same
    COMMITTING/ACTIVATING --every RESEND_S--> the decision again to each peer that has
                          not answered it: Send, or Redial (a new connection) to one
                          that is unreachable                            the same
    ACTIVATING --a peer aborted on its own, or activate_for_s passed, before every
                 peer is active--> Finished(not ok); the decision stands  STALLED

The whole machine is ``COORDINATOR_TABLE``, at the end: (phase, event) ->
(handler, the phases it may lead to). Each ``on_*`` method makes its event and
looks it up; a pair not listed is ignored: the method returns ``[]`` and changes
nothing (a late, resent or out-of-phase message), and so is a message about a
peer that is not the round's. A peer's failure after the round has ended is
noted for ``progress()``, nothing more. A ``preparing`` heartbeat
(``on_preparing``) is noted in any phase and moves none: it is not in the table.

Deadlines: offers until ``start + push_s - commit_window_s`` (a peer's
``preparing`` heartbeat, sent while it loads its weights, moves its own
deadline to ``heartbeat + frame_s``); the commit phase ``commit_window_s``,
within which a lost peer is re-dialled (it may come back with its vote,
``PeerRound.resume``); once ``activate`` is persisted the decision is final:
activation is re-sent, and a lost peer re-dialled, every ``RESEND_S`` until
every peer is active or ``activate_for_s`` (``ACTIVATE_FOR_S``) has passed,
even by a coordinator that restarted. While re-dialled a peer reads
``unreachable`` in ``progress()``, with the reason, never ``failed``: it is
``active`` as soon as it answers. A push that ends STALLED leaves the decision
``activate`` in the plans table: a restart of the coordinator, or the peer's
own ``query`` when it comes back (``coordinator.Coordinator.peer_asked``),
pushes it on.

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
# A decision re-sent (and a lost peer re-dialled) this often until every peer has answered.
RESEND_S: Final = 2.0
# After activate is written, how long the push keeps at a peer that is not active yet: a
# host's reboot, its daemon's start and its stage's load (peer.PREPARE_S) fit inside.
ACTIVATE_FOR_S: Final = 600.0

Decision = Literal["commit", "activate", "active", "abort"]


@dataclass(frozen=True)
class PeerLoad:
    """A loading peer's word in its ``preparing`` heartbeat: parameter bytes read of those
    to read, and for how long it has loaded (its own clock); ``step``: ``loading``, or
    ``downloading`` while a stage of a repo id's model fetches its shards first (bytes
    fetched of those to fetch, ``models/fetch.py``)."""

    done: int
    total: int
    elapsed_s: float
    step: str = "loading"


@dataclass(frozen=True)
class Send:
    peer: str
    kind: str  # offer | commit | activate | abort
    summary: str = ""


@dataclass(frozen=True)
class Redial:
    """Send ``kind`` to ``peer``, over a new connection if its last one was lost (one dial
    at a time per peer: while one is under way, nothing more)."""

    peer: str
    kind: str  # commit | activate


@dataclass(frozen=True)
class Persist:
    decision: Decision
    summary: str = ""


@dataclass(frozen=True)
class Finished:
    ok: bool
    summary: str  # for the operator: each peer that failed, and why


Action = Send | Redial | Persist | Finished


class Phase(StrEnum):
    """The coordinator's round. Not stored: the plans table keeps its ``Decision``s."""

    OFFERING = "offering"
    COMMITTING = "committing"
    ACTIVATING = "activating"
    DONE = "done"
    ABORTED = "aborted"
    STALLED = "stalled"  # activate decided, not every peer active: the push ended anyway


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
    """A refusal, its ``aborted``, a protocol error: the peer answered, and not yes."""

    peer: str
    reason: str


@dataclass(frozen=True)
class PeerLost:
    """Its connection was lost, or it could not be reached: it may come back."""

    peer: str
    reason: str


@dataclass(frozen=True)
class TimerFired:
    """The phase's deadline has passed (``next_deadline()``)."""

    now: float


@dataclass(frozen=True)
class ResendDue:
    """Time to send the decision again to the peers that have not answered it."""

    now: float


CoordinatorEvent = PeerAccepted | PeerCommitted | PeerActivated | PeerFailed | PeerLost


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
    activate_for_s: float = ACTIVATE_FOR_S
    phase: Phase = Phase.OFFERING
    accepted: set[str] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)
    failures: dict[str, str] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)  # lost after the decision
    _heard: dict[str, float] = field(default_factory=dict)
    _load: dict[str, PeerLoad] = field(default_factory=dict)
    _phase_deadline: float = 0.0
    _resend_at: float = 0.0

    def start(self) -> list[Action]:
        """Open a new round: the offers."""
        self._phase_deadline = self.started + self.push_s - self.commit_window_s
        return self._send("offer")

    @classmethod
    def resume(cls, epoch: int, peers: tuple[str, ...], decision: Decision | None,
               now: float, activate_for_s: float = ACTIVATE_FOR_S
               ) -> tuple[CoordinatorRound, list[Action]]:
        """After a restart: an undecided plan is presumed aborted; a commit decision re-runs
        the commit phase (commit is idempotent); an activate decision re-sends activate
        (for ``activate_for_s`` from ``now``)."""
        r = cls(epoch, peers, now, activate_for_s=activate_for_s)
        if decision is None:
            return r, r._abort("the coordinator restarted before deciding")
        if decision == "commit":
            r.phase, r.accepted = Phase.COMMITTING, set(peers)
            r._phase_deadline, r._resend_at = now + r.commit_window_s, now + RESEND_S
            return r, r._send("commit")
        if decision == "activate":
            r.phase, r.accepted, r.committed = Phase.ACTIVATING, set(peers), set(peers)
            r._phase_deadline, r._resend_at = now + r.activate_for_s, now + RESEND_S
            return r, r._send("activate")
        r.phase = Phase.DONE if decision == "active" else Phase.ABORTED
        return r, []

    # -- inputs: each is an event for COORDINATOR_TABLE ------------------------------------

    def on_preparing(self, peer: str, now: float, load: PeerLoad | None = None
                     ) -> list[Action]:
        """A heartbeat while the peer loads its weights: its offer deadline moves on, and
        how far its load is (``load``, when it says) is kept for ``loading``. Noted in any
        phase, and it moves none: not an event for the table."""
        self._heard[peer] = now
        if load is not None:
            self._load[peer] = load
        return []

    def loading(self) -> dict[str, PeerLoad]:
        """How far each peer that is still loading said its load was (its last heartbeat)."""
        return {p: load for p, load in self._load.items()
                if p not in self.accepted and p not in self.failures}

    def on_accepted(self, peer: str, now: float) -> list[Action]:
        return self._handle(PeerAccepted(peer, now))

    def on_committed(self, peer: str, now: float) -> list[Action]:
        return self._handle(PeerCommitted(peer, now))

    def on_active(self, peer: str, now: float) -> list[Action]:
        return self._handle(PeerActivated(peer, now))

    def on_refused(self, peer: str, reason: str) -> list[Action]:
        return self.on_failed(peer, f"refused: {reason}")

    def on_failed(self, peer: str, reason: str) -> list[Action]:
        """A refusal, an ``aborted``, a protocol error: the peer answered no."""
        return self._handle(PeerFailed(peer, reason))

    def on_lost(self, peer: str, reason: str) -> list[Action]:
        """A lost connection, a peer that could not be reached (or re-dialled)."""
        return self._handle(PeerLost(peer, reason))

    def handle_timer(self, now: float) -> list[Action]:
        """Fire the phase's deadline, else the re-send, if due; else do nothing."""
        deadline, resend = self._phase_timer(), self._resend_timer()
        if deadline is not None and now >= deadline:
            return self._dispatch(TimerFired(now))
        if resend is not None and now >= resend:
            return self._dispatch(ResendDue(now))
        return []

    def progress(self) -> dict[str, tuple[str, str]]:
        """Each peer's (state, reason), for the operator: offered, loading (its offer
        checked out; it loads the stage), prepared, committed, active, failed, aborted,
        unreachable (lost after the decision, re-dialled: it may still answer)."""
        out: dict[str, tuple[str, str]] = {}
        for p in self.peers:
            if p in self.failures:
                out[p] = ("failed", self.failures[p])
            elif p in self.active:
                out[p] = ("active", "")
            elif p in self.unreachable:
                out[p] = ("unreachable", f"{self.unreachable[p]}; {self._redialled()}")
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
        due = [t for t in (self._phase_timer(), self._resend_timer()) if t is not None]
        return min(due) if due else None

    def _phase_timer(self) -> float | None:
        """The phase's own deadline: offers, the commit window, activation's bound."""
        if self.phase is Phase.OFFERING:
            waiting = [self._offer_deadline(p) for p in self.peers if p not in self.accepted]
            return min(waiting) if waiting else None
        if self.phase in (Phase.COMMITTING, Phase.ACTIVATING):
            return self._phase_deadline
        return None

    def _resend_timer(self) -> float | None:
        return self._resend_at if self.phase in (Phase.COMMITTING, Phase.ACTIVATING) else None

    def _handle(self, event: CoordinatorEvent) -> list[Action]:
        """A message (or its loss) about one peer: one not in this round is ignored."""
        return self._dispatch(event) if event.peer in self.peers else []

    def _dispatch(self, event: CoordinatorEvent | TimerFired | ResendDue) -> list[Action]:
        row = COORDINATOR_TABLE.get((self.phase, type(event)))
        return [] if row is None else row[0](self, event)

    # -- handlers: one per row of COORDINATOR_TABLE -----------------------------------------

    def _on_accepted(self, e: PeerAccepted) -> list[Action]:
        self.accepted.add(e.peer)
        if self.accepted != set(self.peers):
            return []
        self.phase = Phase.COMMITTING
        self._phase_deadline, self._resend_at = e.now + self.commit_window_s, e.now + RESEND_S
        return [Persist("commit"), *self._send("commit")]

    def _on_committed(self, e: PeerCommitted) -> list[Action]:
        self.committed.add(e.peer)
        self.unreachable.pop(e.peer, None)  # back, and it answered
        if self.committed != set(self.peers):
            return []
        self.phase = Phase.ACTIVATING
        self._phase_deadline, self._resend_at = e.now + self.activate_for_s, e.now + RESEND_S
        return [Persist("activate"), *self._send("activate")]

    def _on_activated(self, e: PeerActivated) -> list[Action]:
        self.active.add(e.peer)
        self.unreachable.pop(e.peer, None)
        return self._activation_settled()

    def _on_failed(self, e: PeerFailed | PeerLost) -> list[Action]:
        self.failures.setdefault(e.peer, e.reason)
        return self._abort(self._summary())

    def _on_lost(self, e: PeerLost) -> list[Action]:
        """Decided, so the peer is not given up: it is re-dialled at the next re-send."""
        self.unreachable[e.peer] = self.unreachable.get(e.peer) or e.reason  # the first why
        return []

    def _on_resend(self, e: ResendDue) -> list[Action]:
        self._resend_at = e.now + RESEND_S
        kind, answered = (("commit", self.committed) if self.phase is Phase.COMMITTING
                          else ("activate", self.active))
        return [Redial(p, kind) if p in self.unreachable else Send(p, kind)
                for p in self.peers if p not in answered and p not in self.failures]

    def _on_failed_when_activating(self, e: PeerFailed) -> list[Action]:
        """Decided activate, and the peer answered no (it aborted on its own): it will not
        come back for this plan, so it is not waited for."""
        self.unreachable.pop(e.peer, None)
        self.failures.setdefault(e.peer, e.reason)
        return self._activation_settled()

    def _on_activation_given_up(self, e: TimerFired) -> list[Action]:
        for p in self.peers:
            if p not in self.active:
                why = self.unreachable.get(p) or "no answer"
                self.failures.setdefault(p, f"{why}; not active {self.activate_for_s:g} s "
                                            "after the decision")
        return self._activation_settled()

    def _on_failed_when_decided(self, e: PeerFailed | PeerLost) -> list[Action]:
        self.failures.setdefault(e.peer, e.reason)  # for progress(); the round has ended
        return []

    def _on_offers_late(self, e: TimerFired) -> list[Action]:
        for p in self.peers:
            if p not in self.accepted and e.now >= self._offer_deadline(p):
                self.failures.setdefault(p, "did not accept in time")
        return self._abort(self._summary())

    def _on_commit_window_closed(self, e: TimerFired) -> list[Action]:
        window = f"{self.commit_window_s:g} s"
        for p in self.peers:
            if p in self.unreachable:
                self.failures.setdefault(p, f"{self.unreachable[p]}; not back within the "
                                            f"commit window ({window})")
            elif p not in self.committed:
                self.failures.setdefault(p, f"did not commit within {window}")
        return self._abort(self._summary())

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
        parts = [f"{p}: " + (self.failures.get(p) or self.unreachable.get(p)
                             or "aborted because another peer failed") for p in did_not]
        return f"plan {self.epoch} aborted; peers that did not commit: " + "; ".join(parts)

    def _activation_settled(self) -> list[Action]:
        """Every peer active: done. Every peer active or given up: the push ends, the
        decision stands (STALLED). Else: keep at it."""
        if self.active == set(self.peers):
            self.phase = Phase.DONE
            return [Persist("active"), Finished(True, f"plan {self.epoch}: every stage of "
                                                      f"{len(self.peers)} is active")]
        if self.active | set(self.failures) != set(self.peers):
            return []
        self.phase = Phase.STALLED
        left = [p for p in self.peers if p not in self.active]
        return [Finished(False, (
            f"plan {self.epoch} is decided active, but {len(left)} of {len(self.peers)} "
            "stage(s) did not answer active: "
            + "; ".join(f"{p}: {self.failures[p]}" for p in left)
            + "; the decision stands: a peer that comes back asks, activates, and this "
            "daemon pushes on (so does its restart); mlxctl cluster deactivate ends the "
            "plan"))]

    def _redialled(self) -> str:
        until = ("until the commit window closes" if self.phase is Phase.COMMITTING else
                 f"for up to {self.activate_for_s:g} s after the decision")
        kind = "commit" if self.phase is Phase.COMMITTING else "activate"
        return f"re-dialled, {kind} re-sent every {RESEND_S:g} s {until}"


_CRow = tuple[Callable[[CoordinatorRound, Any], list[Action]], tuple[Phase, ...]]
_P = Phase

# (phase, event) -> (handler, the phases it may lead to). A pair not listed is ignored: the
# method returns [] and changes nothing (a late, resent or out-of-phase message). A
# TimerFired or ResendDue comes only once due: a phase without that timer never sees it.
COORDINATOR_TABLE: Final[dict[tuple[Phase, type[object]], _CRow]] = {
    (_P.OFFERING, PeerAccepted): (CoordinatorRound._on_accepted, (_P.OFFERING, _P.COMMITTING)),
    (_P.OFFERING, PeerFailed): (CoordinatorRound._on_failed, (_P.ABORTED,)),
    # Undecided: a lost peer's vote cannot be asked again (a new offer of the same epoch is
    # stale to it), so the round ends.
    (_P.OFFERING, PeerLost): (CoordinatorRound._on_failed, (_P.ABORTED,)),
    (_P.OFFERING, TimerFired): (CoordinatorRound._on_offers_late, (_P.ABORTED,)),
    (_P.COMMITTING, PeerCommitted): (CoordinatorRound._on_committed,
                                     (_P.COMMITTING, _P.ACTIVATING)),
    (_P.COMMITTING, PeerFailed): (CoordinatorRound._on_failed, (_P.ABORTED,)),
    (_P.COMMITTING, PeerLost): (CoordinatorRound._on_lost, (_P.COMMITTING,)),
    (_P.COMMITTING, ResendDue): (CoordinatorRound._on_resend, (_P.COMMITTING,)),
    (_P.COMMITTING, TimerFired): (CoordinatorRound._on_commit_window_closed, (_P.ABORTED,)),
    (_P.ACTIVATING, PeerActivated): (CoordinatorRound._on_activated,
                                     (_P.ACTIVATING, _P.DONE, _P.STALLED)),
    (_P.ACTIVATING, PeerFailed): (CoordinatorRound._on_failed_when_activating,
                                  (_P.ACTIVATING, _P.DONE, _P.STALLED)),
    (_P.ACTIVATING, PeerLost): (CoordinatorRound._on_lost, (_P.ACTIVATING,)),
    (_P.ACTIVATING, ResendDue): (CoordinatorRound._on_resend, (_P.ACTIVATING,)),
    (_P.ACTIVATING, TimerFired): (CoordinatorRound._on_activation_given_up, (_P.STALLED,)),
    # The round has ended: noted for progress(), nothing more.
    **{(p, e): (CoordinatorRound._on_failed_when_decided, (p,))
       for p in (_P.DONE, _P.ABORTED, _P.STALLED) for e in (PeerFailed, PeerLost)},
}
