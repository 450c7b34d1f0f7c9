"""Self-healing's decisions (``cluster/healing.py``), sans-IO: the grace, the operator
first, a refusal held until the hosts alive change, a failure retried, fencing; a drained
host re-planned around at once (healing on or off), never planned over; the stages a
heal plans."""

from __future__ import annotations

from mlxceld.cluster.healing import (
    FENCE_RETRY_MAX_S,
    FENCE_RETRY_S,
    Heal,
    Healing,
    Held,
    Idle,
    Replan,
    View,
    Waiting,
    stage_count,
)
from mlxceld.state.liveness import LivenessState

B, C, D, E = "127.0.0.2:19000", "127.0.0.3:19000", "127.0.0.4:19000", "127.0.0.5:19000"
GRACE = 60.0


def view(states: dict[str, tuple[LivenessState, float]], *, epoch: int | None = 7,
         peers: tuple[str, ...] = (B, C), busy: bool = False,
         drained: frozenset[str] = frozenset()) -> View:
    return View(epoch, peers if epoch else (), states, frozenset({B, C, D}), busy=busy,
                drained=drained)


UP = {B: ("alive", 0.0), C: ("alive", 0.0), D: ("alive", 0.0), E: ("alive", 0.0)}
B_DEAD = {**UP, B: ("dead", 100.0)}


def test_a_dead_host_is_healed_around_after_the_grace_only() -> None:
    h = Healing(GRACE)
    assert isinstance(h.decide(view(UP), 500.0), Idle)
    assert h.decide(view(B_DEAD), 100.0) == Waiting(7, (B,), 160.0)
    assert h.decide(view(B_DEAD), 159.9) == Waiting(7, (B,), 160.0)
    assert h.decide(view(B_DEAD), 160.0) == Heal(7, (B,), (C, D))  # the spare included
    # it answered before the grace ended: simply back, nothing re-planned
    assert isinstance(h.decide(view(UP), 150.0), Idle)


def test_only_hosts_alive_are_planned_over() -> None:
    states: dict[str, tuple[LivenessState, float]] = {
        B: ("dead", 100.0), C: ("alive", 0.0), D: ("suspect", 150.0)}
    assert Healing(GRACE).decide(view(states), 200.0) == Heal(7, (B,), (C,))
    two_dead = {**states, C: ("dead", 130.0)}
    # the grace counts from the first host declared dead
    assert Healing(GRACE).decide(view(two_dead), 160.0) == Heal(7, (B, C), ())


def test_off_no_plan_or_the_operator_busy_heals_nothing() -> None:
    assert Healing(0).decide(view(B_DEAD), 1e9) == Idle("self-healing is off "
                                                      "(heal_after_s = 0)")
    assert Healing(GRACE).decide(view(B_DEAD, epoch=None), 1e9) == Idle(
        "no plan is served from here")
    busy = Healing(GRACE).decide(view(B_DEAD, busy=True), 1e9)
    assert isinstance(busy, Idle) and "goes first" in busy.reason


def test_a_refusal_is_held_until_the_hosts_alive_change() -> None:
    h = Healing(GRACE)
    heal = h.decide(view(B_DEAD), 200.0)
    assert isinstance(heal, Heal)
    h.refused(heal, "plan refused: stage-0 ... 4.4 MiB short")
    held = h.decide(view(B_DEAD), 10_000.0)
    assert isinstance(held, Held) and held.reason.startswith("plan refused: stage-0")
    assert "when a host comes back" in held.reason
    # a spare appears (D alive again after a suspicion): tried again at once
    d_was_down = {**B_DEAD, D: ("suspect", 150.0)}
    h2 = Healing(GRACE)
    first = h2.decide(view(d_was_down), 200.0)
    assert first == Heal(7, (B,), (C,))
    h2.refused(first, "too small")
    assert isinstance(h2.decide(view(d_was_down), 300.0), Held)
    assert h2.decide(view(B_DEAD), 301.0) == Heal(7, (B,), (C, D))
    # another plan (an operator's activate) is not held by the old plan's refusal
    assert isinstance(h.decide(view(B_DEAD, epoch=8), 10_000.0), Heal)


def test_a_failed_push_is_tried_again_after_the_grace() -> None:
    h = Healing(GRACE)
    heal = h.decide(view(B_DEAD), 200.0)
    assert isinstance(heal, Heal)
    h.failed(heal, "plan 8: peer C aborted", 200.0)
    assert isinstance(h.decide(view(B_DEAD), 259.0), Held)
    assert isinstance(h.decide(view(B_DEAD), 260.0), Heal)


def test_the_host_left_out_is_fenced_once_alive_not_pulled_in() -> None:
    h = Healing(GRACE)
    h.healed(7, (B, C), (C, D))
    assert h.unfenced() == {B: 7}
    new = view(B_DEAD, epoch=8, peers=(C, D))
    assert h.to_fence(new, 0.0) == []  # still dead: nobody to tell
    assert isinstance(h.decide(new, 1e9), Idle)  # plan 8's hosts are up: B is not needed
    back = view(UP, epoch=8, peers=(C, D))
    assert h.to_fence(back, 0.0) == [(B, 7)]
    assert isinstance(h.decide(back, 1e9), Idle)  # back: a candidate, not pulled in
    h.fenced(B)
    assert h.to_fence(back, 0.0) == [] and h.unfenced() == {}
    # a host of the new plan is never fenced for the old one
    h.healed(8, (C, D), (B, C))
    assert h.unfenced() == {D: 8}


def test_a_fence_that_fails_backs_off_up_to_its_bound() -> None:
    h = Healing(GRACE)
    h.healed(7, (B, C), (C, D))
    back = view(UP, epoch=8, peers=(C, D))
    now, waits = 100.0, []
    for _ in range(8):
        assert h.to_fence(back, now) == [(B, 7)]
        wait = h.fence_failed(B, now)
        waits.append(wait)
        assert h.to_fence(back, now + wait - 0.01) == []  # not before its time
        now += wait
    assert waits == [FENCE_RETRY_S, 2, 4, 8, 16, FENCE_RETRY_MAX_S, FENCE_RETRY_MAX_S,
                     FENCE_RETRY_MAX_S]
    h.fenced(B)  # it got through: nothing left, the backoff forgotten
    assert h.to_fence(back, now) == [] and h.unfenced() == {}
    h.healed(8, (C, D), (C, E))
    h.fence_failed(D, now)
    h.healed(9, (C, E), (D, E))  # D is in the new plan: never fenced, its backoff dropped
    assert h.unfenced() == {C: 9} and h.to_fence(view(UP, epoch=9, peers=(D, E)), now) == [
        (C, 9)]


def test_a_drained_host_is_replanned_around_at_once_healing_on_or_off() -> None:
    for h in (Healing(GRACE), Healing(0)):
        assert h.decide(view(UP, drained=frozenset({C})), 0.0) == Replan(7, (C,), (B, D))
        # a drained host outside the plan (a spare) changes nothing
        assert isinstance(h.decide(view(UP, drained=frozenset({D})), 0.0), Idle)
        # the operator's bring-up or deactivation goes first; no plan, nothing to re-plan
        assert isinstance(h.decide(view(UP, busy=True, drained=frozenset({C})), 0.0), Idle)
        assert h.decide(view(UP, epoch=None, drained=frozenset({C})), 0.0) == Idle(
            "no plan is served from here")


def test_a_drained_host_is_never_planned_over() -> None:
    drained = frozenset({D})  # the spare is drained: a heal plans over C alone
    assert Healing(GRACE).decide(view(B_DEAD, drained=drained), 200.0) == Heal(7, (B,), (C,))


def test_a_replan_that_does_not_fit_is_held_until_the_hosts_alive_change() -> None:
    h = Healing(0)
    first = h.decide(view(UP, drained=frozenset({C})), 0.0)
    assert isinstance(first, Replan)
    h.refused(first, "plan refused: stage-0 ... 4.4 MiB short")
    held = h.decide(view(UP, drained=frozenset({C})), 1e6)
    assert isinstance(held, Held) and held.dead == (C,)
    d_gone = {**UP, D: ("dead", 10.0)}  # the hosts alive change: tried again
    assert h.decide(view(d_gone, drained=frozenset({C})), 1e6) == Replan(7, (C,), (B,))
    # re-planned: the drained host is fenced once the new plan serves
    h.healed(7, (B, C), (B, D))
    assert h.to_fence(view(UP, epoch=8, peers=(B, D), drained=frozenset({C})), 0.0) == [(C, 7)]


def test_a_failed_replan_waits_even_with_healing_off() -> None:
    h = Healing(0)
    first = h.decide(view(UP, drained=frozenset({C})), 100.0)
    assert isinstance(first, Replan)
    h.failed(first, "plan 8: peer D aborted", 100.0)
    assert isinstance(h.decide(view(UP, drained=frozenset({C})), 159.0), Held)
    assert isinstance(h.decide(view(UP, drained=frozenset({C})), 160.0), Replan)


def test_a_heal_plans_as_many_stages_as_before_or_as_many_hosts_as_are_left() -> None:
    """As healer.py says: in as many stages as the plan had, or as many as there are hosts
    alive if fewer. A spare takes a dead host's stage; it never adds one."""
    assert stage_count(2, 2) == 2  # one of two dead, a spare alive: still two stages
    assert stage_count(2, 3) == 2  # two spares alive: still two
    assert stage_count(3, 5) == 3
    assert stage_count(3, 2) == 2  # one of three dead, no spare: two stages
    assert stage_count(2, 1) == 1  # one host of two left: the whole model on it
