"""``engine/pacing.py``: a sequence whose proposals pay keeps proposing (the plain rate
measured now and then), one whose proposals cost more than they give backs off, for
longer each time; fed passes with made-up timings, as a machine would time them."""

from __future__ import annotations

from mlxceld.engine.pacing import FIRST_RUN, MAX_RUN, PROBE, SPECULATE, Pacing


def simulate(pacing: Pacing, passes: int, propose: tuple[int, float],
             plain: tuple[int, float]) -> tuple[list[int], int, float]:
    """``passes`` passes, each giving (tokens, seconds) as its mode does; the k of each,
    the tokens and the seconds in all."""
    ks: list[int] = []
    tokens, seconds = 0, 0.0
    for _ in range(passes):
        k = pacing.k()
        ks.append(k)
        got, took = propose if k else plain
        tokens, seconds = tokens + got, seconds + took
        pacing.record(got, took)
    return ks, tokens, seconds


def test_an_agreeing_draft_keeps_proposing() -> None:
    # k = 4: five tokens a pass for twice a plain pass's time.
    ks, tokens, seconds = simulate(Pacing(4), 400, (5, 2.0), (1, 1.0))
    assert ks[:PROBE] == [4] * PROBE and ks[PROBE:2 * PROBE] == [0] * PROBE
    assert ks[2 * PROBE:2 * PROBE + SPECULATE] == [4] * SPECULATE
    assert ks.count(0) <= 2 * PROBE + (400 // SPECULATE) * PROBE  # a probe now and then
    assert tokens / seconds > 0.9 * 2.5  # within 10% of always proposing


def test_an_unrelated_draft_backs_off_longer_each_time() -> None:
    # One token a pass for three plain passes' time.
    pacing = Pacing(4)
    ks, tokens, seconds = simulate(pacing, 2000, (1, 3.0), (1, 1.0))
    runs = [len(r) for r in "".join("p" if k else "." for k in ks).split("p") if r]
    assert runs[:4] == [PROBE + FIRST_RUN, 2 * FIRST_RUN, 4 * FIRST_RUN, 8 * FIRST_RUN]
    assert max(runs) == MAX_RUN
    assert tokens / seconds > 0.9  # at least 0.9 of plain decoding


def test_a_draft_that_starts_paying_is_taken_back() -> None:
    pacing = Pacing(4)
    simulate(pacing, 300, (1, 3.0), (1, 1.0))  # backed off
    ks, _, _ = simulate(pacing, 2 * MAX_RUN, (5, 2.0), (1, 1.0))  # the text changed
    recent = ks[-4 * SPECULATE:]
    assert recent.count(4) >= 0.9 * len(recent)  # proposing again, a plain probe now and then
