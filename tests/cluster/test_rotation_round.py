"""The rotation's sans-IO round (``cluster/rotation_round.py``): every transition."""

from __future__ import annotations

import pytest

from mlxceld.cluster.rotation_round import NEXT, RotationRound, RoundError, Step, failed_step

MEMBERS = ("10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000")


def fresh() -> RotationRound:
    return RotationRound(1, "a" * 16, "b" * 16, MEMBERS)


def test_each_step_ends_when_every_member_did_it_and_the_table_ends_done() -> None:
    rnd = fresh()
    seen = [rnd.step]
    while not rnd.finished:
        step = rnd.step
        *first, last = rnd.pending()
        for m in first:
            assert rnd.member_done(m, step) is None  # the step waits for the others
        assert rnd.member_done(last, step) == NEXT[step]
        assert rnd.pending() == ([] if rnd.finished else list(MEMBERS))  # all asked again
        seen.append(rnd.step)
    assert seen == [Step.INSTALLING, Step.VERIFYING_INSTALL, Step.USING, Step.VERIFYING_USE,
                    Step.REMOVING, Step.DONE]
    assert rnd.pending() == []


@pytest.mark.parametrize("step", list(NEXT))
def test_a_member_that_fails_a_step_fails_the_rotation_once_the_others_answered(
        step: Step) -> None:
    rnd = RotationRound.resume(1, "a" * 16, "b" * 16, MEMBERS, step, {})
    assert rnd.member_failed(MEMBERS[1], step, "closed: reset") is None
    assert rnd.pending() == [MEMBERS[0], MEMBERS[2]]  # the others still finish the step
    assert rnd.member_failed(MEMBERS[2], step, "no answer within 15 s") is None
    assert rnd.member_done(MEMBERS[0], step) == Step.FAILED
    assert rnd.failures == {MEMBERS[1]: f"{step.value}: closed: reset",
                            MEMBERS[2]: f"{step.value}: no answer within 15 s"}
    assert rnd.finished and rnd.pending() == []


def test_resume_asks_every_member_of_the_written_step_again() -> None:
    rnd = RotationRound.resume(7, "a" * 16, "b" * 16, MEMBERS, Step.USING, {})
    assert rnd.pending() == list(MEMBERS) and rnd.step == Step.USING
    done = RotationRound.resume(7, "a" * 16, "b" * 16, MEMBERS, Step.DONE, {})
    assert done.finished and done.pending() == []


def test_reports_out_of_step_are_our_bug() -> None:
    rnd = fresh()
    with pytest.raises(RoundError, match="step using in step installing"):
        rnd.member_done(MEMBERS[0], Step.USING)
    with pytest.raises(RoundError, match="not a member"):
        rnd.member_done("10.9.9.9:1", Step.INSTALLING)
    rnd.member_done(MEMBERS[0], Step.INSTALLING)
    with pytest.raises(RoundError, match="twice"):
        rnd.member_failed(MEMBERS[0], Step.INSTALLING, "x")
    for m in MEMBERS[1:]:
        rnd.member_failed(m, Step.INSTALLING, "x")
    with pytest.raises(RoundError):
        rnd.member_done(MEMBERS[0], Step.FAILED)


def test_a_failed_round_names_the_step_to_take_up_again() -> None:
    rnd = RotationRound(1, "a" * 16, "b" * 16, ("m1", "m2"), Step.USING)
    rnd.member_done("m1", Step.USING)
    assert rnd.member_failed("m2", Step.USING, "refused: no: really") == Step.FAILED
    assert failed_step(rnd.failures) == Step.USING
    again = RotationRound.resume(1, "a" * 16, "b" * 16, ("m1", "m2"), Step.USING, {})
    assert again.pending() == ["m1", "m2"]  # every member asked again: the steps are idempotent
    assert failed_step({}) is None
    assert failed_step({"m1": "using: x", "m2": "removing: y"}) is None  # not one step
    assert failed_step({"m1": "done: x"}) is None and failed_step({"m1": "nonsense"}) is None
