"""The KV-cache benchmark kept from rotting: ``bench/kvquant.py``'s report on a tiny
fixture (float32: 8 bits keeps (8 + 2 * 32 / 64) / 32 of it) measures all three caches
from mlx's own accounting and meets its goal. It asserts the outcome, not the model's
numbers (the bench prints those for the ``small`` fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.benches import bench_module


@pytest.mark.slow
def test_the_report_measures_each_cache_against_full_precision(
        kv_fixture_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with bench_module("kvquant") as bench:
        reported = bench.report(kv_fixture_dir / "llama", 600, 64)
    assert reported
    out = capsys.readouterr().out
    assert "one sequence of 600 tokens" in out
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines()
            if line.startswith(("full precision ", "8 bits, ", "4 bits, "))}
    assert set(rows) == {"full precision", "8 bits, groups of 64", "4 bits, groups of 64"}
    # nbytes and what the prompt cache keeps: exactly the quantized width; the active
    # memory's growth: the caches, and what else the quantized prefill left alive (tens
    # of KiB here; none on the small fixture)
    for name, ratio in (("8 bits, groups of 64", 0.281), ("4 bits, groups of 64", 0.156)):
        nbytes, _, kept = (float(v) for v in rows[name][1:6:2])
        assert nbytes == kept == ratio, rows[name]
        held, active = (float(rows[name][i].removesuffix("K")) for i in (0, 2))
        assert 0 <= active - held <= 128, rows[name]
    assert "goal <= 0.55: met" in out
