"""A peer's round of the two-phase stage assignment, sans-IO (``coordinator_round`` has
the coordinator's, and the whole exchange).

No sockets, no clock, no SQLite: inputs are the coordinator's messages, the
stage's loading, the answer to a ``Query`` and ``now``; outputs are
``PeerAction``s the shell (``peer.py``) carries out *in order* (a ``Record``
must be durable before the ``Reply`` after it goes out)::

    WAITING --its offer checks out--> Record(preparing), prepare        PREPARING
    WAITING --its offer is refused--> Record(refused), Reply            REFUSED | WAITING
    PREPARING --the stage runs in standby--> Record(accepted), Reply    ACCEPTED
    PREPARING --still loading--> the deadline moves to now + prepare_s  PREPARING
    PREPARING --loading failed, or prepare_s without a sign of it--> stop,
                       Record(refused), Reply                           WAITING
    ACCEPTED --commit--> Record(committed), Reply                       COMMITTED
    COMMITTED --activate--> Record(active), activate, Reply             ACTIVE
    PREPARING/ACCEPTED/COMMITTED --abort--> stop, Record(aborted), Reply ABORTED
    PREPARING/ACCEPTED --a newer offer that checks out--> the same      ABORTED
    ACCEPTED/COMMITTED --phase_s without word--> Query, then the answer's way;
                       --frame_s more, or it cannot be asked--> stop, Record ABORTED
    ABORTED --commit or activate resent--> Reply(aborted, why)          ABORTED
    any --deactivate--> stop (a stage of its own), Record(deactivated), Reply DEACTIVATED

A restart (``resume``: the daemon started again with the round's record) is an
event too, from every record::

    PREPARING --restarted--> stop, Record(aborted): no vote went out    ABORTED
    ACCEPTED/COMMITTED --restarted--> prepare, wait phase_s again       the same
    ACTIVE --restarted--> prepare, activate                             ACTIVE
    ABORTED/REFUSED/DEACTIVATED --restarted--> nothing; a decision resent to it is
                       answered as above

The whole machine is ``PEER_TABLE``, at the end: (state, event) -> (handler,
the states it may lead to). Each ``on_*`` method makes its event and looks it
up; a pair not listed is ignored: the method returns ``[]`` and changes
nothing (a late, resent or out-of-phase message). ``on_other_offer`` also
answers for the offer: ``stale`` whatever the state, ``busy`` while committed,
``keep`` or ``take`` where the table has a ``Superseded`` row, ``take``
elsewhere (the round has ended). Some events were never guarded and are taken
in any state (``from any`` in the table): the round's own offer's verdict (the
shell gives it to a fresh round only), a failed prepare (except after an abort
or a deactivate: that stage was stopped on purpose), and the coordinator's
answer to ``Query`` (it may come after the round moved on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Literal

FRAME_S: Final = 10.0  # one answer (either side's)
PEER_PHASE_S: Final = 60.0  # a peer's wait between phases


class PeerState(StrEnum):
    """A peer's round; each but WAITING is recorded as such in the ``assignments`` table."""

    WAITING = "waiting"  # for the offer's verdict, or after a refusal that is not final
    PREPARING = "preparing"
    ACCEPTED = "accepted"
    COMMITTED = "committed"
    ACTIVE = "active"
    ABORTED = "aborted"
    REFUSED = "refused"
    DEACTIVATED = "deactivated"

    @classmethod
    def recorded(cls, state: str) -> PeerState:
        """The state an ``assignments`` row records (one not known reads as aborted)."""
        known = {s.value for s in cls} - {cls.WAITING.value}
        return cls(state) if state in known else cls.ABORTED


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
HOLDS_A_STAGE: Final = (PeerState.PREPARING, PeerState.ACCEPTED, PeerState.COMMITTED,
                        PeerState.ACTIVE)
OfferVerdict = Literal["take", "stale", "busy", "keep"]


# -- the peer's events: its ``on_*`` methods make them, ``PEER_TABLE`` routes them ---------


@dataclass(frozen=True)
class _At:
    now: float


class OfferAccepted(_At):
    """This round's own offer checked out (``offers.judge``)."""


class StagePrepared(_At):
    """The stage runs in standby."""


class StillLoading(_At):
    """The stage is still loading (the shell's heartbeat while ``prepare`` runs; the
    ``AssignedStage`` ends a load that stops advancing, ``stagehost.LOAD_STALL_S``)."""


class CommitReceived(_At): ...


class AnsweredCommit(_At):
    """The coordinator, asked (``Query``), decided commit."""


class AnsweredActivate(_At):
    """The coordinator, asked, decided activate (or its plan is active)."""


class DeadlinePassed(_At):
    """``deadline`` has passed (``handle_timer``)."""


class Restarted(_At):
    """The daemon started again with this round's record (``resume``)."""


@dataclass(frozen=True)
class _Because:
    reason: str


class PrepareFailed(_Because): ...


class AbortReceived(_Because):
    """``abort``, with the coordinator's summary as the reason."""


class DeactivateReceived(_Because): ...


class QueryFailed(_Because):
    """The coordinator could not be asked."""


class AnsweredOther(_Because):
    """The coordinator, asked, answered anything else (abort, unknown): the reason."""


@dataclass(frozen=True)
class OfferRefused:
    """This round's own offer did not check out."""

    code: str
    reason: str
    final: bool


@dataclass(frozen=True)
class ActivateReceived: ...


@dataclass(frozen=True)
class AnsweredDeactivated:
    """The coordinator, asked, has ended the plan."""


@dataclass(frozen=True)
class Superseded:
    """A newer offer that checks out arrived (``on_other_offer``)."""

    epoch: int


PeerEvent = (OfferAccepted | OfferRefused | StagePrepared | StillLoading | PrepareFailed
             | CommitReceived | ActivateReceived | AbortReceived | DeactivateReceived
             | AnsweredCommit | AnsweredActivate | AnsweredDeactivated | AnsweredOther | QueryFailed
             | Superseded | DeadlinePassed | Restarted)


@dataclass
class PeerRound:
    """One plan epoch, a peer's side: see the module docstring and ``PEER_TABLE``."""

    epoch: int
    state: PeerState = PeerState.WAITING
    phase_s: float = PEER_PHASE_S  # between phases (accepted, committed)
    prepare_s: float = PEER_PHASE_S  # loading the stage in standby
    frame_s: float = FRAME_S
    deadline: float | None = None
    queried: bool = False
    reason: str = ""

    def __post_init__(self) -> None:
        self.state = PeerState(self.state)  # a state read back from SQLite is a str

    @classmethod
    def resume(cls, epoch: int, state: PeerState, now: float, phase_s: float = PEER_PHASE_S,
               reason: str = "") -> tuple[PeerRound, list[PeerAction]]:
        """After a restart, the round as its record (``state``, ``reason``) left it, and
        what ``Restarted`` does there: an unvoted one aborts, a vote or a commit waits again
        (with the standby stage back), an active stage comes back active, an ended round
        stays ended."""
        r = cls(epoch, state, phase_s=phase_s, reason=reason)
        return r, r.on_restart(now)

    # -- inputs: each is an event for PEER_TABLE -------------------------------------------

    def on_restart(self, now: float) -> list[PeerAction]:
        """The daemon started again with this round's record (``resume``)."""
        return self._handle(Restarted(now))

    def on_offer_refused(self, code: str, reason: str, final: bool) -> list[PeerAction]:
        return self._handle(OfferRefused(code, reason, final))

    def on_offer_accepted(self, now: float) -> list[PeerAction]:
        """The offer checks out: load the stage in standby; vote once it is loaded."""
        return self._handle(OfferAccepted(now))

    def on_prepared(self, now: float) -> list[PeerAction]:
        return self._handle(StagePrepared(now))

    def on_still_loading(self, now: float) -> list[PeerAction]:
        """A big stage loads for minutes: its deadline is ``prepare_s`` past the last sign."""
        return self._handle(StillLoading(now))

    def on_prepare_failed(self, reason: str) -> list[PeerAction]:
        return self._handle(PrepareFailed(reason))

    def on_commit(self, now: float) -> list[PeerAction]:
        return self._handle(CommitReceived(now))

    def on_activate(self) -> list[PeerAction]:
        return self._handle(ActivateReceived())

    def on_abort(self, summary: str) -> list[PeerAction]:
        return self._handle(AbortReceived(summary))

    def on_deactivate(self, reason: str) -> list[PeerAction]:
        """The coordinator ended the plan (``deactivate``), whatever this round's state: its
        stage stops (if it has one) and the round is recorded deactivated (a restart does
        not resume it)."""
        return self._handle(DeactivateReceived(reason))

    def on_decision(self, decision: str, now: float) -> list[PeerAction]:
        """The coordinator's answer to ``Query``: commit, activate, abort, deactivated or
        unknown."""
        if decision == "deactivated":
            return self._handle(AnsweredDeactivated())
        if decision == "commit":
            return self._handle(AnsweredCommit(now))
        if decision in ("activate", "active"):
            return self._handle(AnsweredActivate(now))
        return self._handle(AnsweredOther(decision))

    def on_query_failed(self, reason: str) -> list[PeerAction]:
        """The coordinator could not be asked (``Query``): past the deadline, give up."""
        return self._handle(QueryFailed(reason))

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
        if self.state is PeerState.COMMITTED:
            return "busy", []
        if (self.state, Superseded) not in PEER_TABLE:
            return "take", []
        if not valid:
            return "keep", []
        return "take", self._handle(Superseded(epoch))

    def handle_timer(self, now: float) -> list[PeerAction]:
        if self.deadline is None or now < self.deadline:
            return []
        if (self.state, DeadlinePassed) not in PEER_TABLE:
            self.deadline = None  # a state that waits for nothing: no timer to keep firing
            return []
        return self._handle(DeadlinePassed(now))

    def _handle(self, event: PeerEvent) -> list[PeerAction]:
        row = PEER_TABLE.get((self.state, type(event)))
        return [] if row is None else row[0](self, event)

    # -- handlers: one per row of PEER_TABLE ------------------------------------------------

    def _on_offer_refused(self, e: OfferRefused) -> list[PeerAction]:
        self.state, self.reason = (PeerState.REFUSED if e.final else PeerState.WAITING), e.reason
        return [Record(PeerState.REFUSED, f"{e.code}: {e.reason}"), Reply("refused", e.reason)]

    def _on_offer_accepted(self, e: OfferAccepted) -> list[PeerAction]:
        self.state, self.deadline = PeerState.PREPARING, e.now + self.prepare_s
        return [Record(PeerState.PREPARING), StageAction("prepare")]

    def _on_still_loading(self, e: StillLoading) -> list[PeerAction]:
        self.deadline = e.now + self.prepare_s
        return []

    def _on_prepared(self, e: StagePrepared) -> list[PeerAction]:
        self.state, self.deadline = PeerState.ACCEPTED, e.now + self.phase_s
        return [Record(PeerState.ACCEPTED), Reply("accepted")]

    def _on_prepare_failed(self, e: PrepareFailed) -> list[PeerAction]:
        self._end(PeerState.WAITING, e.reason)
        return [StageAction("stop"), Record(PeerState.REFUSED, f"prepare: {e.reason}"),
                Reply("refused", f"the stage could not be prepared: {e.reason}")]

    def _on_loading_too_long(self, e: DeadlinePassed) -> list[PeerAction]:
        return self._on_prepare_failed(
            PrepareFailed(f"loading gave no sign for {self.prepare_s:g} s"))

    def _on_commit(self, e: CommitReceived | AnsweredCommit) -> list[PeerAction]:
        self.state, self.deadline, self.queried = PeerState.COMMITTED, e.now + self.phase_s, False
        return [Record(PeerState.COMMITTED), Reply("committed")]

    def _on_activate(self, e: ActivateReceived | AnsweredActivate) -> list[PeerAction]:
        self.state, self.deadline, self.queried = PeerState.ACTIVE, None, False
        return [Record(PeerState.ACTIVE), StageAction("activate"), Reply("active")]

    def _on_abort(self, e: AbortReceived) -> list[PeerAction]:
        self._end(PeerState.ABORTED, e.reason)
        return [StageAction("stop"), Record(PeerState.ABORTED, e.reason), Reply("aborted")]

    def _on_superseded(self, e: Superseded) -> list[PeerAction]:
        reason = f"superseded by plan {e.epoch}"
        self._end(PeerState.ABORTED, reason)
        return [StageAction("stop"), Record(PeerState.ABORTED, reason),
                Reply("aborted", reason)]

    def _on_deactivate(self, e: DeactivateReceived) -> list[PeerAction]:
        had_stage = self.state in HOLDS_A_STAGE
        self._end(PeerState.DEACTIVATED, e.reason)
        return [*([StageAction("stop")] if had_stage else []),
                Record(PeerState.DEACTIVATED, e.reason), Reply("deactivated")]

    def _on_answered_deactivated(self, e: AnsweredDeactivated) -> list[PeerAction]:
        told = DeactivateReceived("the coordinator deactivated the plan")
        return [a for a in self._on_deactivate(told) if not isinstance(a, Reply)]

    def _answer_again(self, e: CommitReceived | ActivateReceived | AbortReceived
                      | DeactivateReceived) -> list[PeerAction]:
        """A resent message: answered again, nothing changes."""
        return [Reply(self.state.value)]

    def _answer_ended(self, e: CommitReceived | ActivateReceived) -> list[PeerAction]:
        """A decision resent to a round that ended on its own (it gave up waiting, or it
        restarted before voting): the coordinator hears why, nothing changes."""
        return [Reply(self.state.value, self.reason)]

    def _on_restart_unvoted(self, e: Restarted) -> list[PeerAction]:
        """No vote went out, so the coordinator cannot have decided commit: abort, and stop
        the standby stage the previous daemon may have left loading."""
        reason = "restarted before voting"
        self._end(PeerState.ABORTED, reason)
        return [StageAction("stop"), Record(PeerState.ABORTED, reason)]

    def _on_restart_voted(self, e: Restarted) -> list[PeerAction]:
        self.deadline = e.now + self.phase_s
        return [StageAction("prepare")]

    def _on_restart_active(self, e: Restarted) -> list[PeerAction]:
        return [StageAction("prepare"), StageAction("activate")]

    def _on_decided_elsewhere(self, e: AnsweredCommit | AnsweredActivate) -> list[PeerAction]:
        """Decided, but not for us yet (or an answer that came after the round moved on):
        keep waiting, and ask again at the next deadline, where this state has one."""
        if (self.state, DeadlinePassed) in PEER_TABLE:
            self.deadline, self.queried = e.now + self.phase_s, False
        return []

    def _on_answered_other(self, e: AnsweredOther) -> list[PeerAction]:
        return self._give_up(f"the coordinator's decision is {e.reason}")

    def _on_no_word(self, e: DeadlinePassed) -> list[PeerAction]:
        if not self.queried:
            self.queried, self.deadline = True, e.now + self.frame_s
            return [Query()]
        return self._give_up(f"no word from the coordinator for {self.phase_s:g} s")

    def _on_query_failed(self, e: QueryFailed) -> list[PeerAction]:
        if not self.queried:
            return []  # not past the deadline: nothing was asked
        return self._give_up(f"no word from the coordinator for {self.phase_s:g} s, and "
                             f"it cannot be asked: {e.reason}")

    # -- helpers --------------------------------------------------------------------------

    def _end(self, state: PeerState, reason: str) -> None:
        self.state, self.reason, self.deadline = state, reason, None

    def _give_up(self, reason: str) -> list[PeerAction]:
        self._end(PeerState.ABORTED, reason)
        return [StageAction("stop"), Record(PeerState.ABORTED, reason)]


_PRow = tuple[Callable[[PeerRound, Any], list[PeerAction]], tuple[PeerState, ...]]
_S = PeerState
_R = PeerRound

# (state, event) -> (handler, the states it may lead to). A pair not listed is ignored: the
# method returns [] and changes nothing (a late, resent or out-of-phase message); an
# on_other_offer with no Superseded row is taken ("take", []) unless it is stale or busy.
# Several events have no guard and are taken in any state ("from any"), as they always were.
PEER_TABLE: Final[dict[tuple[PeerState, type[object]], _PRow]] = {
    # The round's own offer, judged on a fresh round (WAITING); from any.
    **{(s, OfferAccepted): (_R._on_offer_accepted, (_S.PREPARING,)) for s in _S},
    **{(s, OfferRefused): (_R._on_offer_refused, (_S.REFUSED, _S.WAITING)) for s in _S},
    (_S.PREPARING, StagePrepared): (_R._on_prepared, (_S.ACCEPTED,)),  # the vote
    (_S.PREPARING, DeadlinePassed): (_R._on_loading_too_long, (_S.WAITING,)),
    (_S.PREPARING, StillLoading): (_R._on_still_loading, (_S.PREPARING,)),
    # From any but a round that ended its stage on purpose (ABORTED, DEACTIVATED).
    **{(s, PrepareFailed): (_R._on_prepare_failed, (_S.WAITING,))
       for s in _S if s not in (_S.ABORTED, _S.DEACTIVATED)},
    (_S.PREPARING, Superseded): (_R._on_superseded, (_S.ABORTED,)),
    (_S.ACCEPTED, Superseded): (_R._on_superseded, (_S.ABORTED,)),
    (_S.ACCEPTED, CommitReceived): (_R._on_commit, (_S.COMMITTED,)),
    (_S.COMMITTED, CommitReceived): (_R._answer_again, (_S.COMMITTED,)),
    (_S.COMMITTED, ActivateReceived): (_R._on_activate, (_S.ACTIVE,)),
    (_S.ACTIVE, ActivateReceived): (_R._answer_again, (_S.ACTIVE,)),
    (_S.PREPARING, AbortReceived): (_R._on_abort, (_S.ABORTED,)),
    (_S.ACCEPTED, AbortReceived): (_R._on_abort, (_S.ABORTED,)),
    (_S.COMMITTED, AbortReceived): (_R._on_abort, (_S.ABORTED,)),
    (_S.ABORTED, AbortReceived): (_R._answer_again, (_S.ABORTED,)),
    (_S.ABORTED, CommitReceived): (_R._answer_ended, (_S.ABORTED,)),
    (_S.ABORTED, ActivateReceived): (_R._answer_ended, (_S.ABORTED,)),
    # The daemon started again with this round's record (resume); an ended round: nothing.
    (_S.PREPARING, Restarted): (_R._on_restart_unvoted, (_S.ABORTED,)),
    (_S.ACCEPTED, Restarted): (_R._on_restart_voted, (_S.ACCEPTED,)),
    (_S.COMMITTED, Restarted): (_R._on_restart_voted, (_S.COMMITTED,)),
    (_S.ACTIVE, Restarted): (_R._on_restart_active, (_S.ACTIVE,)),
    # No word between phases: ask the coordinator (Query), then give up.
    (_S.ACCEPTED, DeadlinePassed): (_R._on_no_word, (_S.ACCEPTED, _S.ABORTED)),
    (_S.COMMITTED, DeadlinePassed): (_R._on_no_word, (_S.COMMITTED, _S.ABORTED)),
    (_S.ACCEPTED, QueryFailed): (_R._on_query_failed, (_S.ACCEPTED, _S.ABORTED)),
    (_S.COMMITTED, QueryFailed): (_R._on_query_failed, (_S.COMMITTED, _S.ABORTED)),
    # The coordinator's answer (on_decision), from any: it may come after the round moved.
    (_S.ACCEPTED, AnsweredCommit): (_R._on_commit, (_S.COMMITTED,)),
    **{(s, AnsweredCommit): (_R._on_decided_elsewhere, (s,)) for s in _S if s != _S.ACCEPTED},
    (_S.ACCEPTED, AnsweredActivate): (_R._on_activate, (_S.ACTIVE,)),
    (_S.COMMITTED, AnsweredActivate): (_R._on_activate, (_S.ACTIVE,)),
    **{(s, AnsweredActivate): (_R._on_decided_elsewhere, (s,))
       for s in _S if s not in (_S.ACCEPTED, _S.COMMITTED)},
    **{(s, AnsweredOther): (_R._on_answered_other, (_S.ABORTED,)) for s in _S},
    **{(s, AnsweredDeactivated): (_R._on_answered_deactivated, (_S.DEACTIVATED,))
       for s in _S if s != _S.DEACTIVATED},
    # The coordinator ended the plan, from any.
    **{(s, DeactivateReceived): (_R._on_deactivate, (_S.DEACTIVATED,))
       for s in _S if s != _S.DEACTIVATED},
    (_S.DEACTIVATED, DeactivateReceived): (_R._answer_again, (_S.DEACTIVATED,)),
}
