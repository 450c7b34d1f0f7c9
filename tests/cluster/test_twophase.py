"""The two-phase assignment's state machines, driven step by step (no sockets, no clock)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, TypeVar

from mlxceld.cluster.assignment.coordinator_round import (
    ACTIVATE_FOR_S,
    COMMIT_WINDOW_S,
    COORDINATOR_TABLE,
    PUSH_S,
    RESEND_S,
    CoordinatorRound,
    Finished,
    PeerAccepted,
    PeerActivated,
    PeerCommitted,
    PeerFailed,
    PeerLoad,
    PeerLost,
    Persist,
    Phase,
    Redial,
    ResendDue,
    Send,
    TimerFired,
)
from mlxceld.cluster.assignment.peer_round import (
    PEER_PHASE_S,
    PEER_TABLE,
    AbortReceived,
    ActivateReceived,
    AnsweredActivate,
    AnsweredCommit,
    AnsweredDeactivated,
    AnsweredOther,
    CommitReceived,
    DeactivateReceived,
    DeadlinePassed,
    OfferAccepted,
    OfferRefused,
    PeerRound,
    PeerState,
    PrepareFailed,
    Query,
    QueryFailed,
    Record,
    Reply,
    Restarted,
    StageAction,
    StagePrepared,
    StillLoading,
    Superseded,
)

PEERS = ("stage-0", "stage-1", "stage-2")
S = TypeVar("S", bound=StrEnum)


def sends(actions: list[object], kind: str) -> list[str]:
    return [a.peer for a in actions if isinstance(a, Send) and a.kind == kind]


def test_a_round_that_succeeds_persists_each_decision_before_sending_it() -> None:
    r = CoordinatorRound(7, PEERS, started=0.0)
    assert sends(r.start(), "offer") == list(PEERS)
    assert r.on_accepted("stage-0", 1) == [] and r.on_accepted("stage-1", 1) == []
    out = r.on_accepted("stage-2", 2)
    assert out[0] == Persist("commit") and sends(out, "commit") == list(PEERS)
    assert r.on_committed("stage-0", 3) == r.on_committed("stage-1", 3) == []
    out = r.on_committed("stage-2", 3)
    assert out[0] == Persist("activate") and sends(out, "activate") == list(PEERS)
    for p in PEERS[:2]:
        assert r.on_active(p, 4) == []
    out = r.on_active("stage-2", 4)
    assert out[0] == Persist("active") and isinstance(out[1], Finished) and out[1].ok
    assert r.phase is Phase.DONE


def test_a_peer_lost_between_accepted_and_commit_aborts_everyone_naming_it() -> None:
    r = CoordinatorRound(3, PEERS, started=0.0)
    r.start()
    for p in PEERS:
        r.on_accepted(p, 1)
    r.on_committed("stage-0", 2)
    out = r.on_failed("stage-1", "connection lost")
    assert isinstance(out[0], Persist) and out[0].decision == "abort"
    assert sends(out, "abort") == list(PEERS)
    done = out[-1]
    assert isinstance(done, Finished) and not done.ok
    assert "stage-1: connection lost" in done.summary and "stage-2" in done.summary
    assert "stage-0" not in done.summary  # it committed
    assert r.phase is Phase.ABORTED and r.on_committed("stage-1", 3) == []


def test_refusal_during_offers_aborts_with_the_reason() -> None:
    r = CoordinatorRound(1, PEERS, started=0.0)
    r.start()
    r.on_accepted("stage-0", 1)
    out = r.on_refused("stage-2", "model mismatch")
    assert isinstance(out[-1], Finished) and "stage-2: refused: model mismatch" in out[-1].summary


def test_offer_deadline_and_heartbeats() -> None:
    r = CoordinatorRound(1, PEERS, started=0.0)
    r.start()
    offer_end = PUSH_S - COMMIT_WINDOW_S
    assert r.next_deadline() == offer_end
    r.on_accepted("stage-0", 1)
    r.on_accepted("stage-1", 1)
    r.on_preparing("stage-2", offer_end - 1)  # still loading: it may take a bit longer
    assert r.handle_timer(offer_end) == []
    out = r.handle_timer(offer_end + 20)
    assert isinstance(out[-1], Finished) and "stage-2: did not accept in time" in out[-1].summary


def test_heartbeats_say_how_far_each_peer_has_loaded() -> None:
    """Kept for the operator (bring-up's ``loading``): a peer's last word, until it votes;
    a heartbeat without one keeps what was said; nothing moves in the round."""
    r = CoordinatorRound(1, PEERS, started=0.0)
    r.start()
    r.on_preparing("stage-0", 2, PeerLoad(10, 100, 1.5))
    r.on_preparing("stage-1", 2)
    r.on_preparing("stage-0", 4)
    assert r.loading() == {"stage-0": PeerLoad(10, 100, 1.5)}
    r.on_preparing("stage-0", 6, PeerLoad(60, 100, 5.5))
    assert r.loading() == {"stage-0": PeerLoad(60, 100, 5.5)}
    assert r.progress()["stage-0"] == ("loading", "")  # no step per heartbeat
    r.on_accepted("stage-0", 7)
    assert r.loading() == {}


def test_commit_window_then_abort() -> None:
    r = CoordinatorRound(1, PEERS[:2], started=0.0)
    r.start()
    r.on_accepted("stage-0", 5)
    r.on_accepted("stage-1", 5)
    r.on_committed("stage-0", 6)
    assert r.handle_timer(5 + RESEND_S - 0.1) == []
    assert r.handle_timer(5 + RESEND_S) == [Send("stage-1", "commit")]  # not answered yet
    assert r.handle_timer(5 + COMMIT_WINDOW_S - 0.1) == [Send("stage-1", "commit")]
    out = r.handle_timer(5 + COMMIT_WINDOW_S)
    assert isinstance(out[-1], Finished) and "stage-1: did not commit" in out[-1].summary


def activating(peers: tuple[str, ...] = PEERS[:2]) -> CoordinatorRound:
    """A round that decided activate at time 2."""
    r = CoordinatorRound(1, peers, started=0.0)
    r.start()
    for p in peers:
        r.on_accepted(p, 1)
    for p in peers:
        r.on_committed(p, 2)
    assert r.phase is Phase.ACTIVATING
    return r


def test_after_activate_the_decision_stands_and_activation_is_resent() -> None:
    r = activating()
    r.on_active("stage-0", 3)
    assert r.on_lost("stage-1", "connection lost: reset") == []
    assert r.handle_timer(2 + RESEND_S) == [Redial("stage-1", "activate")]
    assert r.phase is Phase.ACTIVATING


def test_a_peer_lost_after_the_decision_is_unreachable_until_it_answers() -> None:
    """Re-dialled every RESEND_S, reported unreachable with the first reason (never failed),
    and active as soon as it answers."""
    r = activating()
    r.on_active("stage-0", 3)
    r.on_lost("stage-1", "connection lost: reset")
    state, why = r.progress()["stage-1"]
    assert state == "unreachable" and why.startswith("connection lost: reset; re-dialled, "
                                                      "activate re-sent every 2 s")
    for t in (4, 6, 8):
        assert r.handle_timer(t) == [Redial("stage-1", "activate")]
        assert r.on_lost("stage-1", "cannot connect: refused") == []  # still down
    assert r.progress()["stage-1"] == (state, why)  # the first reason, not each try's
    out = r.on_active("stage-1", 9)
    assert out[0] == Persist("active") and isinstance(out[1], Finished) and out[1].ok
    assert r.progress() == {"stage-0": ("active", ""), "stage-1": ("active", "")}


def test_a_peer_lost_while_committing_is_redialled_within_the_commit_window() -> None:
    r = CoordinatorRound(1, PEERS[:2], started=0.0)
    r.start()
    r.on_accepted("stage-0", 1)
    r.on_accepted("stage-1", 1)
    r.on_committed("stage-0", 2)
    assert r.on_lost("stage-1", "connection lost: reset") == [] and r.phase is Phase.COMMITTING
    assert r.handle_timer(1 + RESEND_S) == [Redial("stage-1", "commit")]
    assert r.progress()["stage-1"][0] == "unreachable"
    out = r.on_committed("stage-1", 4)  # back with its vote (PeerRound.resume)
    assert out[0] == Persist("activate") and r.progress()["stage-1"] == ("committed", "")
    late = CoordinatorRound(2, PEERS[:2], started=0.0)
    late.start()
    late.on_accepted("stage-0", 1)
    late.on_accepted("stage-1", 1)
    late.on_lost("stage-1", "connection lost: reset")
    out = late.handle_timer(1 + COMMIT_WINDOW_S)
    assert isinstance(out[0], Persist) and out[0].decision == "abort"
    assert isinstance(out[-1], Finished) and (
        "stage-1: connection lost: reset; not back within the commit window (10 s)"
        in out[-1].summary)
    assert late.progress()["stage-1"][0] == "failed"


def test_a_lost_peer_before_the_decision_aborts_at_once() -> None:
    r = CoordinatorRound(1, PEERS[:2], started=0.0)
    r.start()
    r.on_accepted("stage-0", 1)
    out = r.on_lost("stage-1", "connection lost: reset")  # its vote cannot be asked again
    assert isinstance(out[0], Persist) and out[0].decision == "abort"
    assert isinstance(out[-1], Finished) and "stage-1: connection lost: reset" in out[-1].summary


def test_activation_gives_up_after_its_bound_and_the_decision_stands() -> None:
    r = activating()
    r.on_active("stage-0", 3)
    r.on_lost("stage-1", "connection lost: reset")
    assert r.next_deadline() == 2 + RESEND_S
    assert r.handle_timer(100) == [Redial("stage-1", "activate")]  # the bound is not reached
    out = r.handle_timer(2 + ACTIVATE_FOR_S)
    assert len(out) == 1 and isinstance(out[0], Finished) and not out[0].ok  # no Persist
    assert r.phase is Phase.STALLED and r.next_deadline() is None
    assert out[0].summary.startswith(
        "plan 1 is decided active, but 1 of 2 stage(s) did not answer active: stage-1: "
        "connection lost: reset; not active 600 s after the decision; the decision stands")


def test_a_peer_that_aborted_on_its_own_is_not_waited_for() -> None:
    """Decided activate, but the peer answers aborted (it gave up waiting): it will not come
    back for this plan; once every other peer is active the push ends, the decision kept."""
    r = activating(PEERS)
    r.on_active("stage-0", 3)
    assert r.on_failed("stage-1", "aborted: no word from the coordinator") == []
    assert r.handle_timer(2 + RESEND_S) == [Send("stage-2", "activate")]  # not stage-1
    out = r.on_active("stage-2", 5)
    assert len(out) == 1 and isinstance(out[0], Finished) and not out[0].ok
    assert "stage-1: aborted: no word from the coordinator" in out[0].summary
    assert r.phase is Phase.STALLED


def test_a_failure_after_the_round_ended_is_noted_for_the_operator_only() -> None:
    r = activating()
    r.on_active("stage-0", 3)
    r.on_active("stage-1", 3)
    assert r.phase is Phase.DONE and r.on_failed("stage-0", "closed") == []
    assert r.on_lost("stage-1", "connection lost") == []
    assert r.progress() == {"stage-0": ("failed", "closed"),
                            "stage-1": ("failed", "connection lost")}


def test_a_restarted_coordinator_resumes_from_its_decision() -> None:
    _, out = CoordinatorRound.resume(4, PEERS, None, now=100)
    assert sends(out, "abort") == list(PEERS) and isinstance(out[0], Persist)
    r, out = CoordinatorRound.resume(4, PEERS, "commit", now=100)
    assert sends(out, "commit") == list(PEERS) and r.phase is Phase.COMMITTING
    r, out = CoordinatorRound.resume(4, PEERS, "activate", now=100)
    assert sends(out, "activate") == list(PEERS) and r.phase is Phase.ACTIVATING
    r.on_lost("stage-1", "cannot connect: refused")  # re-dialled, for ACTIVATE_FOR_S
    assert r.handle_timer(100 + RESEND_S)[1] == Redial("stage-1", "activate")
    assert isinstance(r.handle_timer(100 + ACTIVATE_FOR_S)[0], Finished)
    r, out = CoordinatorRound.resume(4, PEERS, "active", now=100)
    assert out == [] and r.phase is Phase.DONE


def test_a_resumed_activation_keeps_at_it_for_its_own_bound() -> None:
    """The bound a restarted coordinator (or a peer's query) resumes with: a test's shorter
    one (push.ACTIVATING_S, MLXCELD_TEST_ACTIVATE_FOR_S) counts from the resume."""
    r, _ = CoordinatorRound.resume(4, PEERS[:2], "activate", now=100, activate_for_s=4)
    r.on_active("stage-0", 101)
    r.on_lost("stage-1", "cannot connect: refused")
    assert r.handle_timer(103.9) == [Redial("stage-1", "activate")]
    out = r.handle_timer(104)
    assert isinstance(out[0], Finished) and r.phase is Phase.STALLED
    assert "not active 4 s after the decision" in out[0].summary


def test_a_peer_votes_after_loading_and_persists_before_replying() -> None:
    p = PeerRound(2)
    assert p.on_offer_accepted(0) == [Record("preparing"), StageAction("prepare")]
    assert p.on_prepared(5) == [Record("accepted"), Reply("accepted")]
    assert p.on_commit(6) == [Record("committed"), Reply("committed")]
    assert p.on_commit(6.5) == [Reply("committed")]  # resent: answered again, no new state
    assert p.on_activate() == [Record("active"), StageAction("activate"), Reply("active")]
    assert p.on_activate() == [Reply("active")]
    assert p.on_abort("too late") == []  # an active stage stays active


def test_a_peer_aborts_on_abort_and_after_its_deadline() -> None:
    p = PeerRound(2)
    p.on_offer_accepted(0)
    p.on_prepared(1)
    assert p.on_abort("stage-1 failed") == [StageAction("stop"), Record("aborted",
                                                                        "stage-1 failed"),
                                            Reply("aborted")]
    q = PeerRound(3)
    q.on_offer_accepted(0)
    q.on_prepared(1)
    assert q.handle_timer(1 + PEER_PHASE_S) == [Query()]
    out = q.handle_timer(1 + PEER_PHASE_S + 10)
    assert out[0] == StageAction("stop") and q.state == "aborted"
    s = PeerRound(4)
    s.on_offer_accepted(0)
    s.on_prepared(1)
    s.handle_timer(1 + PEER_PHASE_S)
    assert s.on_decision("commit", 70) == [Record("committed"), Reply("committed")]
    t = PeerRound(5)
    t.on_offer_accepted(0)
    t.on_prepared(1)
    assert t.on_decision("unknown", 70)[1] == Record(
        "aborted", "the coordinator's decision is unknown")


def test_a_late_answer_leaves_no_timer_to_spin_on() -> None:
    """The peer asked, then activate came on its own; the answer to the question arrives
    after: the active round waits for nothing, so its timer does not fire forever."""
    p = accepted_round(6)
    p.on_commit(2)
    assert p.handle_timer(2 + PEER_PHASE_S) == [Query()]
    p.on_activate()
    assert p.on_decision("activate", 70) == [] and p.deadline is None
    p.deadline = 80.0  # a deadline left over in a state with none: dropped, not kept
    assert p.handle_timer(1e6) == [] and p.deadline is None


def test_a_peer_told_decided_asks_again_instead_of_giving_up() -> None:
    p = accepted_round(7)
    p.on_commit(2)
    assert p.handle_timer(2 + PEER_PHASE_S) == [Query()]
    assert p.on_decision("commit", 70) == []  # decided, the activate is not here yet
    assert p.handle_timer(70 + PEER_PHASE_S) == [Query()] and p.state == "committed"


def test_a_peer_that_restarts_comes_back_where_it_was() -> None:
    assert PeerRound.resume(1, "active", 0)[1] == [StageAction("prepare"),
                                                   StageAction("activate")]
    r, out = PeerRound.resume(1, "committed", 0)
    assert out == [StageAction("prepare")] and r.deadline == PEER_PHASE_S
    assert r.on_activate() == [Record("active"), StageAction("activate"), Reply("active")]


def test_a_peer_restarted_before_voting_aborts_and_says_so_when_asked_again() -> None:
    """Killed while loading (record ``preparing``): no vote went out, so it aborts at once,
    stopping the stage it left loading; a commit or activate re-sent to it is answered."""
    r, out = PeerRound.resume(1, "preparing", 0)
    assert out == [StageAction("stop"), Record("aborted", "restarted before voting")]
    assert (r.state, r.deadline) == ("aborted", None)
    assert r.on_commit(1) == [Reply("aborted", "restarted before voting")]
    assert r.on_activate() == [Reply("aborted", "restarted before voting")]
    r, out = PeerRound.resume(2, "aborted", 0, reason="stage-1 failed")
    assert out == [] and r.on_activate() == [Reply("aborted", "stage-1 failed")]
    for ended in ("refused", "deactivated"):
        r, out = PeerRound.resume(3, ended, 0)  # type: ignore[arg-type]
        assert out == [] and r.on_commit(1) == [] and r.on_activate() == [], ended


def test_refusals_final_or_back_to_waiting() -> None:
    p = PeerRound(1)
    assert p.on_offer_refused("model", "other model", final=True)[1] == Reply("refused",
                                                                             "other model")
    assert p.state == "refused"
    q = PeerRound(1)
    q.on_offer_refused("cluster_name", "other cluster", final=False)
    assert q.state == "waiting"


def accepted_round(epoch: int) -> PeerRound:
    p = PeerRound(epoch)
    p.on_offer_accepted(0)
    p.on_prepared(1)
    return p


def test_a_newer_good_offer_supersedes_an_undecided_round() -> None:
    for prepared in (False, True):  # preparing (loading), then accepted (voted)
        p = PeerRound(5)
        p.on_offer_accepted(0)
        if prepared:
            p.on_prepared(1)
        outcome, out = p.on_other_offer(6, valid=True)
        assert outcome == "take" and out == [
            StageAction("stop"), Record("aborted", "superseded by plan 6"),
            Reply("aborted", "superseded by plan 6")]
        assert p.state == "aborted" and p.deadline is None
        assert p.on_prepared(2) == []  # the old round is over, and says so if asked
        assert p.on_commit(2) == [Reply("aborted", "superseded by plan 6")]


def test_an_older_or_equal_offer_is_stale_and_the_round_goes_on() -> None:
    p = accepted_round(5)
    assert p.on_other_offer(4, valid=True) == ("stale", [])
    assert p.on_other_offer(5, valid=True) == ("stale", [])
    assert p.state == "accepted" and p.on_commit(2) == [Record("committed"),
                                                         Reply("committed")]


def test_a_bad_newer_offer_does_not_disturb_an_undecided_round() -> None:
    p = accepted_round(5)
    assert p.on_other_offer(9, valid=False) == ("keep", [])
    assert p.state == "accepted"


def test_a_committed_round_is_decided_so_a_newer_offer_is_busy() -> None:
    p = accepted_round(5)
    p.on_commit(2)
    assert p.on_other_offer(6, valid=True) == ("busy", [])
    assert p.state == "committed"


def test_an_ended_round_makes_way_without_actions() -> None:
    for end in ("active", "aborted", "refused", "waiting"):
        p = PeerRound(5, state=end)  # type: ignore[arg-type]
        assert p.on_other_offer(6, valid=False) == ("take", []), end


def test_a_coordinator_that_cannot_be_asked_ends_the_round() -> None:
    p = accepted_round(5)
    assert p.on_query_failed("refused") == []  # not past the deadline: nothing asked yet
    assert p.handle_timer(1 + PEER_PHASE_S) == [Query()]
    out = p.on_query_failed("connection refused")
    assert out[0] == StageAction("stop") and p.state == "aborted"
    assert isinstance(out[1], Record) and "cannot be asked: connection refused" in out[1].reason


def test_the_wait_between_phases_is_separate_from_loading() -> None:
    p = PeerRound(5, phase_s=2.0)
    p.on_offer_accepted(0)
    assert p.deadline == PEER_PHASE_S  # loading keeps its own bound
    p.on_prepared(10)
    assert p.deadline == 12.0
    r, _ = PeerRound.resume(5, "accepted", 100, phase_s=2.0)
    assert r.deadline == 102.0


def test_a_load_that_goes_on_is_waited_for_past_prepare_s() -> None:
    """A big stage loads for minutes: each sign that it still loads (the shell's heartbeat,
    while the AssignedStage sees its bytes advance) moves the deadline; silence does not."""
    p = PeerRound(6, prepare_s=10.0)
    p.on_offer_accepted(0)
    for now in range(5, 100, 5):
        assert p.on_still_loading(now) == [] and p.deadline == now + 10.0
        assert p.handle_timer(now + 1) == []
    assert p.on_prepared(101) == [Record("accepted"), Reply("accepted")]
    q = PeerRound(7, prepare_s=10.0)
    q.on_offer_accepted(0)
    q.on_still_loading(5)
    out = q.handle_timer(15)
    assert out[0] == StageAction("stop") and q.state == "waiting"
    assert out[-1] == Reply("refused", "the stage could not be prepared: loading gave no "
                            "sign for 10 s")
    assert q.on_still_loading(20) == []  # after the round moved on: nothing


def test_a_deactivated_round_stops_its_stage_whatever_its_state() -> None:
    p = PeerRound(2)
    p.on_offer_accepted(0)
    p.on_prepared(1)
    p.on_commit(2)
    p.on_activate()
    assert p.on_deactivate("by mlxctl") == [StageAction("stop"), Record("deactivated",
                                                                        "by mlxctl"),
                                            Reply("deactivated")]
    assert (p.state, p.deadline) == ("deactivated", None)
    assert p.on_deactivate("again") == [Reply("deactivated")]  # resent: answered, once
    assert p.on_activate() == [] and p.on_abort("late") == [] and p.handle_timer(1e9) == []
    assert p.on_other_offer(3, True) == ("take", [])  # a later plan is judged as usual
    assert p.on_prepare_failed("stage worker is missing") == []  # it was stopped for this
    q = PeerRound(4)
    q.on_offer_accepted(0)
    q.on_prepared(1)
    q.handle_timer(1 + PEER_PHASE_S)  # asks the coordinator, which ended the plan
    assert q.on_decision("deactivated", 70) == [
        StageAction("stop"), Record("deactivated", "the coordinator deactivated the plan")]
    assert q.state == "deactivated"
    r = PeerRound(5)
    r.on_offer_refused("busy", "plan 4 is committed here", final=False)
    assert r.on_deactivate("x") == [Record("deactivated", "x"), Reply("deactivated")]  # no
    # stage of its own: the stage that runs here (plan 4's) is not this round's to stop


# -- the tables walked: every (state, event) pair, listed or not ---------------------------


def reachable(table: Mapping[tuple[S, type[object]], tuple[object, tuple[S, ...]]],
              start: S) -> set[S]:
    """The states the table's declared targets lead to from ``start``."""
    seen, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for (state, _), (_, targets) in table.items():
            if state == here:
                todo += [t for t in targets if t not in seen]
                seen.update(targets)
    return seen


def coordinator_in(phase: Phase) -> CoordinatorRound:
    """A round of three peers in ``phase``: one peer has moved on, two are still to."""
    r = CoordinatorRound(1, PEERS, started=0.0)
    r.start()
    r.on_preparing("stage-2", 1)
    r.on_accepted("stage-0", 1)
    for step, then in ((r.on_accepted, r.on_committed), (r.on_committed, r.on_active),
                       (r.on_active, None)):
        if r.phase is phase:
            return r
        if phase is Phase.ABORTED:
            r.on_failed("stage-1", "connection lost")
            return r
        if phase is Phase.STALLED and r.phase is Phase.ACTIVATING:
            for p in PEERS[1:]:
                r.on_failed(p, "aborted: no word from the coordinator")
            return r
        for p in PEERS:
            step(p, 2)
        if then is not None:
            then("stage-0", 3)
    assert r.phase is phase
    return r


COORDINATOR_INPUTS: dict[type[object], Callable[[CoordinatorRound, str], list[Any]]] = {
    PeerAccepted: lambda r, p: r.on_accepted(p, 5),
    PeerCommitted: lambda r, p: r.on_committed(p, 5),
    PeerActivated: lambda r, p: r.on_active(p, 5),
    PeerFailed: lambda r, p: r.on_refused(p, "model mismatch"),
    PeerLost: lambda r, p: r.on_lost(p, "connection lost"),
}
TIMERS = (TimerFired, ResendDue)


def test_the_coordinator_table_every_phase_every_event() -> None:
    """A listed pair leads where the table says; a pair not listed, or a message about a
    peer not in the round, returns [] and changes nothing; a timer not yet due neither."""
    assert reachable(COORDINATOR_TABLE, Phase.OFFERING) == set(Phase)
    assert {event for _, event in COORDINATOR_TABLE} <= {*COORDINATOR_INPUTS, *TIMERS}
    seen: set[Phase] = set()
    for phase in Phase:
        for event, feed in COORDINATOR_INPUTS.items():
            r = coordinator_in(phase)
            for peer in ("elsewhere:1", *PEERS):  # the last may complete the phase
                before = copy.deepcopy(r)
                out = feed(r, peer)
                row = COORDINATOR_TABLE.get((before.phase, event))
                if row is None or peer not in PEERS:
                    assert (out, r) == ([], before), (phase, event, peer)
                else:
                    assert r.phase in row[1], (phase, event, peer, r.phase)
                    seen.add(r.phase)
        r = coordinator_in(phase)
        before = copy.deepcopy(r)
        assert r.on_preparing("stage-1", 5) == [] and r.phase is phase  # noted, no event
        r = before
        due = r.next_deadline()
        timers = [t for t in TIMERS if (phase, t) in COORDINATOR_TABLE]
        assert (due is None) == (not timers), phase
        before = copy.deepcopy(r)
        assert r.handle_timer(1e9 if due is None else due - 0.01) == [] and r == before
        if due is not None:  # the first timer due, then the phase's deadline (far later)
            r.handle_timer(due)
            assert r.phase in {q for t in timers for q in COORDINATOR_TABLE[(phase, t)][1]}
            seen.add(r.phase)
            r = copy.deepcopy(before)
            r.handle_timer(1e9)
            assert r.phase in COORDINATOR_TABLE[(phase, TimerFired)][1], phase
            seen.add(r.phase)
    assert seen == set(Phase)


def peer_in(state: PeerState, *, queried: bool = False) -> PeerRound:
    """A round of plan 5 in ``state``; ``queried``: it has asked the coordinator."""
    on: list[Callable[[PeerRound], object]] = [
        lambda p: p.on_offer_accepted(0), lambda p: p.on_prepared(1),
        lambda p: p.on_commit(2), lambda p: p.on_activate()]
    path = {PeerState.WAITING: [], PeerState.PREPARING: on[:1], PeerState.ACCEPTED: on[:2],
            PeerState.COMMITTED: on[:3], PeerState.ACTIVE: on,
            PeerState.ABORTED: [*on[:2], lambda p: p.on_abort("stage-1 failed")],
            PeerState.REFUSED: [lambda p: p.on_offer_refused("model", "other", final=True)],
            PeerState.DEACTIVATED: [lambda p: p.on_deactivate("by mlxctl")]}
    p = PeerRound(5)
    for step in path[state]:
        step(p)
    if queried:
        assert p.handle_timer(1e3) == [Query()]
    assert p.state is state and p.queried is queried
    return p


PEER_INPUTS: list[tuple[type[object], Callable[[PeerRound], list[Any]]]] = [
    (OfferAccepted, lambda p: p.on_offer_accepted(500)),
    (OfferRefused, lambda p: p.on_offer_refused("model", "other model", True)),
    (OfferRefused, lambda p: p.on_offer_refused("busy", "plan 4 is committed", False)),
    (StagePrepared, lambda p: p.on_prepared(500)),
    (StillLoading, lambda p: p.on_still_loading(500)),
    (PrepareFailed, lambda p: p.on_prepare_failed("out of memory")),
    (CommitReceived, lambda p: p.on_commit(500)),
    (ActivateReceived, lambda p: p.on_activate()),
    (AbortReceived, lambda p: p.on_abort("stage-1 failed")),
    (DeactivateReceived, lambda p: p.on_deactivate("by mlxctl")),
    (AnsweredCommit, lambda p: p.on_decision("commit", 500)),
    (AnsweredActivate, lambda p: p.on_decision("activate", 500)),
    (AnsweredActivate, lambda p: p.on_decision("active", 500)),
    (AnsweredDeactivated, lambda p: p.on_decision("deactivated", 500)),
    (AnsweredOther, lambda p: p.on_decision("abort", 500)),
    (AnsweredOther, lambda p: p.on_decision("unknown", 500)),
    (QueryFailed, lambda p: p.on_query_failed("connection refused")),
    (DeadlinePassed, lambda p: p.handle_timer(1e9)),
    (Restarted, lambda p: p.on_restart(500)),
]


def test_the_peer_table_every_state_every_event() -> None:
    """A listed pair leads where the table says; a pair not listed returns [] and changes
    nothing; a timer not yet due neither."""
    assert reachable(PEER_TABLE, PeerState.WAITING) == set(PeerState)
    assert {event for _, event in PEER_TABLE} == {e for e, _ in PEER_INPUTS} | {Superseded}
    seen: set[PeerState] = set()
    for state in PeerState:
        asked = (False, True) if state in (PeerState.ACCEPTED, PeerState.COMMITTED) else (False,)
        for queried in asked:
            for event, feed in PEER_INPUTS:
                p = peer_in(state, queried=queried)
                before = copy.deepcopy(p)
                out = feed(p)
                row = PEER_TABLE.get((state, event))
                if row is None:
                    assert (out, p) == ([], before), (state, queried, event)
                else:
                    assert p.state in row[1], (state, queried, event, p.state)
                    seen.add(p.state)
            p = peer_in(state, queried=queried)
            before = copy.deepcopy(p)
            soon = 1e9 if p.deadline is None else p.deadline - 0.01
            assert p.handle_timer(soon) == [] and p == before
    assert seen == set(PeerState)


def test_an_other_offer_every_state() -> None:
    """Stale whatever the state, busy while committed; where the table has no Superseded
    row the round has ended and the offer is taken; where it has one, a bad offer is kept
    out and a good one supersedes the round."""
    for state in PeerState:
        for epoch, valid in ((4, True), (5, True), (6, True), (6, False)):
            p = peer_in(state)
            before = copy.deepcopy(p)
            verdict, out = p.on_other_offer(epoch, valid)
            row = PEER_TABLE.get((state, Superseded))
            if epoch <= 5:
                expected = "stale"
            elif state is PeerState.COMMITTED:
                expected = "busy"
            elif row is None or valid:
                expected = "take"
            else:
                expected = "keep"
            assert verdict == expected, (state, epoch, valid)
            if row is not None and expected == "take":
                assert p.state in row[1] and out[0] == StageAction("stop")
            else:
                assert (out, p) == ([], before), (state, epoch, valid)
