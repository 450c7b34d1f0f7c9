"""The failure detector's state machine, sans IO: time is an argument, nothing sleeps."""

from __future__ import annotations

import pytest

from mlxceld.config.liveness import LivenessConfig
from mlxceld.discovery.detector import _TRANSITIONS, Detector, Transitioned

T = LivenessConfig(ping_interval_s=1.0, suspect_after_s=3.0, dead_after_s=10.0)
A, B = "10.0.0.2:19000", "10.0.0.3:19000"


def states(ts: list[Transitioned]) -> list[tuple[str, str, str]]:
    return [(t.address, t.old, t.new) for t in ts]


def test_the_table_is_the_documented_machine() -> None:
    assert _TRANSITIONS == {
        ("unknown", "answered"): "alive", ("suspect", "answered"): "alive",
        ("dead", "answered"): "alive", ("unknown", "suspect_silence"): "suspect",
        ("alive", "suspect_silence"): "suspect", ("suspect", "dead_silence"): "dead"}


def test_alive_suspect_dead_and_back_by_the_clock() -> None:
    d = Detector(T)
    d.track(A, 100.0)
    assert d.state(A) == "unknown" and d.next_deadline() == 103.0
    assert states(d.answered(A, 100.5)) == [(A, "unknown", "alive")]
    assert d.answered(A, 101.5) == []  # alive stays alive, silently
    assert d.next_deadline() == 104.5
    assert d.handle_timer(104.49) == []
    d.failed(A, "no pong within 3 s")
    [suspect] = d.handle_timer(104.5)
    assert (suspect.old, suspect.new, suspect.at) == ("alive", "suspect", 104.5)
    assert suspect.reason == "no answer to pings for 3 s; last error: no pong within 3 s"
    assert d.next_deadline() == 111.5  # dead counts from the last answer too
    [dead] = d.handle_timer(111.5)
    assert (dead.old, dead.new) == ("suspect", "dead") and "10 s" in dead.reason
    assert d.next_deadline() is None and d.handle_timer(1000.0) == []  # dead until it answers
    [back] = d.answered(A, 1000.0)
    assert (back.old, back.new) == ("dead", "alive")
    assert back.reason == "answered again after 898.5 s without an answer"
    assert d.next_deadline() == 1003.0


def test_suspect_answers_before_dead() -> None:
    d = Detector(T)
    d.track(A, 0.0)
    d.answered(A, 0.0)
    assert states(d.handle_timer(5.0)) == [(A, "alive", "suspect")]
    assert states(d.answered(A, 6.0)) == [(A, "suspect", "alive")]
    assert d.handle_timer(8.5) == [] and d.state(A) == "alive"


def test_a_late_timer_passes_through_suspect_at_the_thresholds() -> None:
    d = Detector(T)
    d.track(A, 0.0)
    d.answered(A, 0.0)
    out = d.handle_timer(60.0)  # the loop was busy: both thresholds lie behind
    assert states(out) == [(A, "alive", "suspect"), (A, "suspect", "dead")]
    assert [t.at for t in out] == [3.0, 10.0]


def test_a_peer_that_never_answered_says_so() -> None:
    d = Detector(T)
    d.track(A, 0.0)
    d.failed(A, "dial: unreachable: could not connect")
    [t] = d.handle_timer(3.0)
    assert (t.old, t.new) == ("unknown", "suspect")
    assert "none since this daemon began watching it" in t.reason
    assert "dial: unreachable" in t.reason
    d.answered(A, 4.0)
    assert d.state(A) == "alive"  # the error is cleared by an answer
    [t] = d.handle_timer(7.0)
    assert "last error" not in t.reason and "none since" not in t.reason


def test_peers_are_independent_and_forgotten() -> None:
    d = Detector(T)
    d.track(A, 0.0)
    d.track(B, 0.0)
    d.answered(A, 0.0)
    d.answered(B, 2.0)
    assert states(d.handle_timer(3.0)) == [(A, "alive", "suspect")]
    d.forget(A)
    assert d.addresses() == [B] and d.answered(A, 4.0) == [] and d.state(A) is None
    d.failed(A, "ignored")  # a late report of a forgotten peer changes nothing
    assert d.next_deadline() == 5.0


@pytest.mark.parametrize("state", ["alive", "suspect", "dead"])
def test_a_state_from_the_database_is_kept_and_silence_counts_from_now(state: str) -> None:
    d = Detector(T)
    d.track(A, 50.0, state)  # type: ignore[arg-type]
    d.track(A, 99.0)  # tracking twice changes nothing
    assert d.state(A) == state
    if state == "dead":
        assert d.next_deadline() is None
    else:
        assert d.next_deadline() == (53.0 if state == "alive" else 60.0)
    assert states(d.answered(A, 51.0)) == ([] if state == "alive" else [(A, state, "alive")])
