"""The speculative decoding benchmark kept from rotting: ``bench/speculative.py``'s report
on a tiny pair measures every row, ours (one host and a 2-stage pipeline of daemons, its
stages pinned to CPUs of their own) and
mlx-lm's, and says what the counters say:
every proposal of the agreeing draft accepted, none of the unrelated one's. It asserts the
outcome, not the speeds (the bench prints those for the ``small`` target)."""

from __future__ import annotations

import functools

import pytest

from helpers.benches import bench_module


@pytest.mark.slow
def test_the_report_measures_ours_and_mlx_lm_with_both_drafts(
        capsys: pytest.CaptureFixture[str]) -> None:
    with bench_module("speculative") as bench:
        # the stages pinned as --pin does (each worker's threads on a CPU of its own)
        rows = bench.report(bench.fixtures("tiny"), 48, 4, repeats=1,
                            more=functools.partial(bench.pipeline_rows, pin=True))
    got = {(r.engine, r.draft): r for r in rows}
    assert set(got) == {(e, d) for e in ("ours", "mlx-lm", "ours, 2 pinned")
                        for d in (None, "agreeing", "unrelated")}
    assert all(r.tok_s > 0 for r in rows)
    for engine in ("ours", "mlx-lm", "ours, 2 pinned"):
        assert got[engine, "agreeing"].acceptance > 0.95  # mlx-lm's: estimated from flags
        assert got[engine, "unrelated"].acceptance < 0.2
    assert got["ours", "agreeing"].per_pass > 4  # k accepted and the target's own
    out = capsys.readouterr().out
    assert "ours / mlx-lm: none " in out and "k = 4" in out
    assert "2 stages, draft agreeing: " in out and "of which waiting for the draft" in out
    assert "passes drafted ahead" in out
