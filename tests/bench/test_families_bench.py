"""The families benchmark kept from rotting: its ``--quick`` run (tiny fixtures, 8 tokens,
1 run) of qwen2 (which mlx-lm pipelines) and gemma3_text (which it does not) measures
every target that applies, gets the same tokens from all of them, reports each stage's
memory against its share, and leaves no process behind. It asserts the outcome, not the
speed (bench/families.py prints that)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from helpers.benches import bench_module


@pytest.fixture(scope="module")
def families() -> Iterator[ModuleType]:
    with bench_module("families") as module:
        yield module


@pytest.mark.slow
def test_the_quick_run_measures_all_three_with_the_same_tokens(
        families: ModuleType, state_dir: Path) -> None:
    """qwen2 through all three (one family: each is a cluster of three daemons to start,
    and the suite's time is short); the family mlx-lm does not pipeline is below."""
    settings = families.Settings(quick=True, max_tokens=8, runs=1, timeout_s=120,
                                 fixtures=state_dir / "fixtures")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    [r] = families.run(["qwen2"], settings, state_dir / "run")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before

    assert r.no_pipeline is None and r.failures == {}
    streams = r.single + r.ours + r.pipeline
    assert [s.tokens for s in streams] == [8] * 3
    assert all(s.decode_tps > 0 for s in streams)
    assert (r.ours_differ, r.pipeline_differ) == (0, 0)
    ours = [m for m in r.memory if m.who.startswith("ours")]
    assert [m.layers for m in ours] == [(0, 1), (1, 2)]
    assert [m.layers for m in r.memory[2:]] == [(0, 1), (1, 2)]  # mlx-lm's two ranks
    assert all(m.rss > 0 and m.share > 0 for m in r.memory)
    assert all(m.loaded is not None and m.loaded > 0 for m in ours)  # once loaded
    # The stages' shares are the whole model's weights, its tied embeddings on both.
    assert sum(m.share for m in ours) > r.weights

    text = families.report([r], settings, families.Bare(mlx=50 << 20, stage=90 << 20))
    assert "ours / mlx-lm pipeline" in text
    assert "tokens differing from mlx-lm single: ours 0, mlx-lm pipeline 0" in text


def test_a_family_mlx_lm_cannot_pipeline_is_named(families: ModuleType,
                                                  state_dir: Path) -> None:
    settings = families.Settings(quick=True, fixtures=state_dir / "fixtures")
    for family, problem in (("gemma3_text", "mlx-lm has no pipeline for gemma3_text"),
                            ("qwen3_moe", None)):
        path = families.fixture(family, settings, state_dir)
        assert families.pipeline_problem(path) == problem
