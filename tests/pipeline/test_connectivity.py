"""A stage link's connectivity, sans-IO: transitions once per change, the bounded backoff."""

from __future__ import annotations

import pytest

from mlxceld.pipeline.connectivity import (
    RETRY_INITIAL_S,
    RETRY_MAX_S,
    Connectivity,
    Transition,
)


def test_backoff_doubles_to_its_bound_and_starts_over_once_attached_or_lost() -> None:
    c = Connectivity()
    assert [c.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert (RETRY_INITIAL_S, RETRY_MAX_S) == (0.5, 5.0)
    c.attached(1.0)
    assert c.next_delay() == 0.5 and c.next_delay() == 1.0
    c.lost("closed", 2.0)
    assert c.next_delay() == 0.5


def test_a_repeated_failure_is_one_transition_and_each_change_is_one() -> None:
    c = Connectivity(initial_s=0.1, max_s=0.4)
    assert c.state == "connecting" and not c.up and c.error is None
    first = c.failed("unreachable", "s1 is unavailable: refused", 10.0)
    assert first == Transition("connecting", "unreachable", "s1 is unavailable: refused")
    # The same failure again: no transition (nothing to log), but the newest message.
    assert c.failed("unreachable", "s1 is unavailable: timed out", 11.0) is None
    assert c.error == "s1 is unavailable: timed out" and c.since == 10.0 and c.failures == 2
    assert c.failed("standby", "s1 is in standby", 12.0) == Transition(
        "unreachable", "standby", "s1 is in standby")
    assert c.failed("standby", "s1 is in standby", 13.0) is None
    assert c.attached(14.0) == Transition("standby", "attached", None)
    assert c.up and c.error is None and c.failures == 0 and c.since == 14.0
    assert c.attached(15.0) is None
    assert c.lost("s1 is unavailable: closed", 16.0) == Transition(
        "attached", "disconnected", "s1 is unavailable: closed")
    assert c.failed("model_mismatch", "other model", 17.0) == Transition(
        "disconnected", "model_mismatch", "other model")


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="0 < initial_s <= max_s"):
        Connectivity(initial_s=2.0, max_s=1.0)
    with pytest.raises(ValueError, match="'broken'"):
        Connectivity().failed("broken", "x", 0.0)  # type: ignore[arg-type]


def test_a_silent_link_stays_silent_while_nobody_answers_and_refuses_requests() -> None:
    c = Connectivity(initial_s=0.1, max_s=0.4)
    c.attached(1.0)
    c.next_delay()
    assert c.admits
    assert c.silent("s1 is silent: nothing for 3 s", 5.0) == Transition(
        "attached", "silent", "s1 is silent: nothing for 3 s")
    assert not c.admits and not c.up and c.next_delay() == 0.1  # the backoff starts over
    # Re-dials that find nobody answering: still silent, since the same time, newest words.
    assert c.failed("unreachable", "s1 is unreachable: no handshake", 9.0) is None
    assert (c.state, c.since, c.error) == ("silent", 5.0, "s1 is unreachable: no handshake")
    assert c.attached(12.0) == Transition("silent", "attached", None)
    assert c.admits and c.since == 12.0
    # A failure that says more than silence (its stage refuses us) leaves silence.
    c.silent("quiet", 13.0)
    assert c.failed("refused", "s1 refused the handshake", 14.0) == Transition(
        "silent", "refused", "s1 refused the handshake")
    assert c.admits


def test_a_stage_failed_on_its_host_is_its_own_state_and_says_more_than_silent() -> None:
    c = Connectivity()
    c.attached(1.0)
    c.silent("s1 is silent", 2.0)
    said = "stage s1 failed to load layers [2, 4): a shard is missing (on node m2; ...)"
    assert c.failed("failed", said, 3.0) == Transition("silent", "failed", said)
    assert c.admits and c.error == said  # a request dials: the stand-in answers at once
    assert c.failed("failed", said, 4.0) is None and c.since == 3.0
    assert c.attached(5.0) == Transition("failed", "attached", None)
