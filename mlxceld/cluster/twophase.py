"""The two-phase stage assignment, sans-IO: the coordinator's round and a peer's.

No sockets, no clock, no SQLite: inputs are messages, connection losses and
``now``; outputs are ``Action``s the shell carries out *in order* (a ``Persist``
must be durable before the ``Send`` after it goes out).

The coordinator (one ``CoordinatorRound`` per plan epoch)::

    OFFERING  --every peer accepted-->  Persist(commit), Send(commit)  COMMITTING
    COMMITTING --every peer committed--> Persist(activate), Send(activate) ACTIVATING
    ACTIVATING --every peer active-->    Persist(active)                 DONE
    OFFERING or COMMITTING --a refusal, a lost peer, a deadline-->
                                         Persist(abort), Send(abort)     ABORTED

Deadlines: offers until ``start + push_s - commit_window_s`` (a peer's
``preparing`` heartbeat, sent while it loads its weights, moves its own
deadline to ``heartbeat + frame_s``); the commit phase ``commit_window_s``; once
``activate`` is persisted the decision is final: activation is re-sent until
every peer is active (``resend_s``), even by a coordinator that restarted.

A peer (``PeerRound``) persists its vote before it sends it and follows the
coordinator's decisions; every message carries the epoch, and anything about
another epoch is ignored. An offer of another plan while a round is on
(``PeerRound.on_other_offer``): an older or equal epoch is refused as stale; a
newer one that checks out supersedes an undecided round (preparing, accepted:
its stage stops, it is recorded aborted and its coordinator told) and starts
its own; a committed round is decided, so the newer offer is refused as busy
until it ends (active, or aborted after its deadline).

After the round, the coordinator may end the plan (``PeerRound.on_deactivate``,
`mlxctl cluster deactivate`, ``deactivation.py``): from any state the stage
stops and the round is recorded deactivated, which a restart does not resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Literal

PUSH_S: Final = 60.0  # the coordinator's whole push
COMMIT_WINDOW_S: Final = 10.0  # always left for the commit phase
FRAME_S: Final = 10.0  # one answer
PEER_PHASE_S: Final = 60.0  # a peer's wait between phases
PEER_IDLE_S: Final = 600.0  # a peer's wait for any assignment
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


# -- the peer ---------------------------------------------------------------------------

PeerState = Literal["waiting", "preparing", "accepted", "committed", "active", "aborted",
                    "refused", "deactivated"]


@dataclass(frozen=True)
class Reply:
    kind: str  # preparing | accepted | refused | committed | active | aborted | deactivated
    reason: str = ""


@dataclass(frozen=True)
class Record:
    """Persist the peer's state for this epoch (before the ``Reply`` after it)."""

    state: PeerState
    reason: str = ""


@dataclass(frozen=True)
class StageAction:
    """Start the stage worker in standby (weights loaded, not serving), switch it to
    active, or stop it."""

    what: Literal["prepare", "activate", "stop"]


@dataclass(frozen=True)
class Query:
    """Ask the coordinator what it decided (the peer waited past its deadline)."""


PeerAction = Reply | Record | StageAction | Query
# The states in which this round's stage worker runs or loads; in the others the stage
# that runs, if any, is another round's.
HOLDS_A_STAGE: Final = ("preparing", "accepted", "committed", "active")
OfferVerdict = Literal["take", "stale", "busy", "keep"]


@dataclass
class PeerRound:
    epoch: int
    state: PeerState = "waiting"
    phase_s: float = PEER_PHASE_S  # between phases (accepted, committed)
    prepare_s: float = PEER_PHASE_S  # loading the stage in standby
    frame_s: float = FRAME_S
    deadline: float | None = None
    queried: bool = False
    reason: str = ""

    @classmethod
    def resume(cls, epoch: int, state: PeerState, now: float, phase_s: float = PEER_PHASE_S
               ) -> tuple[PeerRound, list[PeerAction]]:
        """After a restart: a vote or a commit waits again (with the standby stage back);
        an active stage comes back active."""
        r = cls(epoch, state, phase_s=phase_s)
        if state in ("accepted", "committed"):
            r.deadline = now + r.phase_s
            return r, [StageAction("prepare")]
        if state == "preparing":  # no vote was sent: nothing to wait for
            r.state = "aborted"
            return r, [Record("aborted", "restarted before voting")]
        if state == "active":
            return r, [StageAction("prepare"), StageAction("activate")]
        return r, []

    def on_offer_refused(self, code: str, reason: str, final: bool) -> list[PeerAction]:
        self.state, self.reason = ("refused" if final else "waiting"), reason
        return [Record("refused", f"{code}: {reason}"), Reply("refused", reason)]

    def on_offer_accepted(self, now: float) -> list[PeerAction]:
        """The offer checks out: load the stage in standby; vote once it is loaded."""
        self.state, self.deadline = "preparing", now + self.prepare_s
        return [Record("preparing"), StageAction("prepare")]

    def on_prepared(self, now: float) -> list[PeerAction]:
        if self.state != "preparing":
            return []
        self.state, self.deadline = "accepted", now + self.phase_s
        return [Record("accepted"), Reply("accepted")]

    def on_prepare_failed(self, reason: str) -> list[PeerAction]:
        if self.state in ("aborted", "deactivated"):
            return []  # the stage was stopped on purpose, which ended its loading
        self.state, self.reason, self.deadline = "waiting", reason, None
        return [StageAction("stop"), Record("refused", f"prepare: {reason}"),
                Reply("refused", f"the stage could not be prepared: {reason}")]

    def on_commit(self, now: float) -> list[PeerAction]:
        if self.state == "committed":
            return [Reply("committed")]  # a resent commit: answer again
        if self.state != "accepted":
            return []
        self.state, self.deadline, self.queried = "committed", now + self.phase_s, False
        return [Record("committed"), Reply("committed")]

    def on_activate(self) -> list[PeerAction]:
        if self.state == "active":
            return [Reply("active")]
        if self.state != "committed":
            return []
        self.state, self.deadline = "active", None
        return [Record("active"), StageAction("activate"), Reply("active")]

    def on_abort(self, summary: str) -> list[PeerAction]:
        if self.state in ("active", "aborted", "refused", "waiting", "deactivated"):
            return [Reply("aborted")] if self.state == "aborted" else []
        self.state, self.reason, self.deadline = "aborted", summary, None
        return [StageAction("stop"), Record("aborted", summary), Reply("aborted")]

    def on_deactivate(self, reason: str) -> list[PeerAction]:
        """The coordinator ended the plan (``deactivate``), whatever this round's state: its
        stage stops (if it has one) and the round is recorded deactivated (a restart does
        not resume it)."""
        if self.state == "deactivated":
            return [Reply("deactivated")]  # a resent deactivate: answer again
        had_stage = self.state in HOLDS_A_STAGE
        self.state, self.reason, self.deadline = "deactivated", reason, None
        return [*([StageAction("stop")] if had_stage else []), Record("deactivated", reason),
                Reply("deactivated")]

    def on_decision(self, decision: str, now: float) -> list[PeerAction]:
        """The coordinator's answer to ``Query``: commit, activate, abort, deactivated or
        unknown."""
        if decision == "deactivated":
            return [a for a in self.on_deactivate("the coordinator deactivated the plan")
                    if not isinstance(a, Reply)]
        if decision == "commit" and self.state == "accepted":
            return self.on_commit(now)
        if decision in ("activate", "active") and self.state in ("accepted", "committed"):
            self.state = "committed"
            return self.on_activate()
        if decision in ("commit", "activate", "active"):
            self.deadline = now + self.phase_s  # decided, but not for us yet: keep waiting
            return []
        return self._give_up(f"the coordinator's decision is {decision}")

    def on_query_failed(self, reason: str) -> list[PeerAction]:
        """The coordinator could not be asked (``Query``): past the deadline, give up."""
        if self.state not in ("accepted", "committed") or not self.queried:
            return []
        return self._give_up(f"no word from the coordinator for {self.phase_s:g} s, and "
                             f"it cannot be asked: {reason}")

    def on_other_offer(self, epoch: int, valid: bool) -> tuple[OfferVerdict, list[PeerAction]]:
        """An offer of plan ``epoch`` arrived while this round is here; ``valid``: it passed
        every check but the epoch (``offers.judge``). Returns what becomes of the offer, and
        the actions that end this round first when the offer takes over:

        - ``stale``: ``epoch`` is not newer than this round's; refuse it, this round goes on;
        - ``busy``: this round is committed (decided): refuse it until the round ends;
        - ``keep``: a newer but bad offer does not disturb an undecided round: refuse it
          with its own reason, unrecorded, and this round goes on;
        - ``take``: a newer good offer supersedes an undecided round (preparing, accepted:
          its stage stops, it is recorded aborted, its coordinator is told), or this
          round has ended (active, aborted, refused, waiting): judge the offer as usual.
        """
        if epoch <= self.epoch:
            return "stale", []
        if self.state == "committed":
            return "busy", []
        if self.state not in ("preparing", "accepted"):
            return "take", []
        if not valid:
            return "keep", []
        reason = f"superseded by plan {epoch}"
        self.state, self.reason, self.deadline = "aborted", reason, None
        return "take", [StageAction("stop"), Record("aborted", reason),
                        Reply("aborted", reason)]

    def handle_timer(self, now: float) -> list[PeerAction]:
        if self.deadline is None or now < self.deadline:
            return []
        if self.state == "preparing":
            return self.on_prepare_failed(f"loading took longer than {self.prepare_s:g} s")
        if self.state in ("accepted", "committed"):
            if not self.queried:
                self.queried, self.deadline = True, now + self.frame_s
                return [Query()]
            return self._give_up(f"no word from the coordinator for {self.phase_s:g} s")
        return []

    def _give_up(self, reason: str) -> list[PeerAction]:
        self.state, self.reason, self.deadline = "aborted", reason, None
        return [StageAction("stop"), Record("aborted", reason)]
