"""The measured speed-plan benchmark kept from rotting: its ``--quick`` run (the tiny
fixture 8 layers deep, two pinned peer daemons, the slow one held by a cgroup CPU quota
where one can be made, else by a busy neighbour on its CPU) activates the speed-weighted
plan and the memory-weighted one in turn, decodes through both, prints both numbers and
leaves no process and no cgroup behind. It asserts the outcome, not which plan is faster
(bench/plan_speed_measured.py prints that)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from helpers.benches import bench_module


@pytest.fixture(scope="module")
def speed_bench() -> Iterator[ModuleType]:
    with bench_module("plan_speed_measured") as module:
        yield module


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins two hosts to two CPUs")
def test_the_quick_run_decodes_through_both_plans(speed_bench: ModuleType) -> None:
    # The speed plan's units declared 2:1: measured ones could come out equal on a loaded
    # machine (then no plan splits by speed); each host still measures its own at start.
    quota = 0.25 if speed_bench.probe() is None else None  # as root: the quota's path
    settings = speed_bench.Settings(quick=True, max_tokens=8, requests=1, rounds=1,
                                    units=[2.0, 1.0], quota=quota,
                                    neighbours=0 if quota else 1)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # a short root: the daemons' sockets are under it, and AF_UNIX paths end at 108 bytes
    root = Path(tempfile.mkdtemp(prefix="mxps", dir="/tmp"))
    try:
        runs, text = speed_bench.bench(root, settings)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    if quota is not None:
        with bench_module("cpuquota") as cpuquota:
            version, parent = cpuquota.hierarchy()
        assert not list(parent.glob(f"mxspeed-{os.getpid()}-*"))
        assert "held to 0.25 CPU by a cgroup quota, with 0 busy neighbour(s)" in text
        assert f"cgroup v{version}: each daemon in its own, weighted 100x" in text
    else:
        assert "with 1 busy neighbour(s)" in text

    assert [r.rule for r in runs] == ["speed", "memory"]
    for r in runs:
        assert [s["split_rule"] for s in r.stages] == [r.rule] * 2
        (a, b), (c, d) = (s["layers"] for s in r.stages)
        assert (a, b == c, d) == (0, True, 8)
        assert len(r.tps) == 1 and r.tps[0] > 0
    memory = runs[1].stages  # the declared memory gives the slow host (stage-1) 6 of 8
    assert memory[1]["layers"][1] - memory[1]["layers"][0] >= 6
    assert [s["compute_units"] for s in memory] == [1.0, 1.0]
    assert [s["compute_units"] for s in runs[0].stages] == [2.0, 1.0]
    assert runs[0].stages[0]["layers"][1] >= 5  # the fast host (stage-0) takes more
    assert f"memory-weighted (A) {runs[1].tps[0]:.2f} tok/s" in text
    assert f"speed-weighted (B) {runs[0].tps[0]:.2f} tok/s" in text
    assert "B/A " in text


def test_the_declared_memory_gives_the_slow_host_more_layers(speed_bench: ModuleType) -> None:
    from mlxceld.cluster.plan.model import usable_memory
    from mlxceld.cluster.plan.solver import PlanNode, plan_stages
    from mlxceld.models import fixture_cache, preset
    from mlxceld.models.profile import layer_profile

    model = fixture_cache(preset("tiny", layers=8))
    fast, slow = speed_bench.memory_caps(model, 0.75)
    assert slow > fast
    profile = layer_profile(model)

    def split(units: tuple[float, float] | tuple[None, None]) -> list[tuple[int, int]]:
        nodes = [PlanNode("fast", "127.0.0.2:19000", usable_memory(fast), 19100, units[0]),
                 PlanNode("slow", "127.0.0.3:19000", usable_memory(slow), 19100, units[1])]
        return [s.layers for s in plan_stages(profile, 2, nodes).stages]

    assert split((None, None)) == [(0, 2), (2, 8)]
    assert split((2.0, 1.0))[0][1] >= 5  # a 2:1 speed split fits the fast host's memory
