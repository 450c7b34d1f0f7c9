"""Zero-config bring-up, measured: how long each part takes against its goal.

One function per measurement, each returning a ``Row``; ``main`` prints them
as one table with the ratio to the goal (below 1 is within it) and the CPU time,
which other load on the machine does not move. So far:

- planner: ``plan_stages`` for 100 nodes of mixed memory (16-80 GiB) and a
  200-layer model, the median of ``--runs`` runs (goal: well under a second);
- planner, refused: the same when nothing fits (the closest split and the
  per-node shortfall message);
- profile (with ``--model DIR``): ``layer_profile`` of a real checkpoint, which
  reads its safetensors headers only.

    .venv/bin/python bench/bringup.py [--runs 9] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxceld.cluster.planner import PlanNode, PlanRefused, plan_stages
from mlxceld.models.profile import LayerProfile, layer_profile

GIB = 1 << 30
NODES, LAYERS = 100, 200


@dataclass(frozen=True)
class Row:
    name: str
    times: list[float]  # wall-clock seconds
    cpu: list[float]  # this process's CPU seconds, unmoved by other load on the machine
    goal: float  # seconds

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def timed(runs: int, job: Callable[[], object]) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU seconds of ``runs`` calls of ``job``."""
    wall, cpu = [], []
    for _ in range(runs):
        start, start_cpu = time.perf_counter(), time.process_time()
        job()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def synthetic(layers: int) -> LayerProfile:
    """A 70B-like bfloat16 model: 200 layers of 800 MiB, 2 GiB embeddings and head."""
    return LayerProfile(layer_bytes=(800 << 20,) * layers, embed_bytes=2 * GIB,
                        head_bytes=2 * GIB, norm_bytes=16 << 10, other_bytes=0, tied=False,
                        dtype_bytes=2, hidden_size=8192, kv_bytes_per_token=2 * 8 * 128 * 2)


def candidates(n: int, scale: int = 1) -> list[PlanNode]:
    """``n`` peers of 16, 32, 48, 64 or 80 GiB (divided by ``scale``)."""
    return [PlanNode(f"peer-{i}", f"10.0.{i // 250}.{i % 250 + 1}:19000",
                     (16 + 16 * (i % 5)) * GIB // scale, 19100) for i in range(n)]


def measure_planner(runs: int) -> Row:
    profile, nodes = synthetic(LAYERS), candidates(NODES)
    return Row(f"planner, {NODES} nodes x {LAYERS} layers",
               *timed(runs, lambda: plan_stages(profile, NODES, nodes)), goal=1.0)


def measure_refused_plan(runs: int) -> Row:
    profile, nodes = synthetic(LAYERS), candidates(NODES, scale=16)

    def refuse() -> None:
        try:
            plan_stages(profile, NODES, nodes)
        except PlanRefused:
            return
        raise AssertionError("the plan was expected not to fit")

    return Row(f"planner, {NODES} x {LAYERS}, refused", *timed(runs, refuse), goal=1.0)


def measure_profile(runs: int, model: Path) -> Row:
    return Row(f"profile of {model.name}", *timed(runs, lambda: layer_profile(model)),
               goal=0.1)


def render(rows: list[Row]) -> str:
    lines = [f"{'measurement':36}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'cpu ms':>9}"
             f"{'goal ms':>9}{'x goal':>8}"]
    for r in rows:
        lines.append(f"{r.name:36}{r.median * 1e3:11.1f}{min(r.times) * 1e3:9.1f}"
                     f"{max(r.times) * 1e3:9.1f}{statistics.median(r.cpu) * 1e3:9.1f}"
                     f"{r.goal * 1e3:9.0f}{r.median / r.goal:8.3f}")
    lines.append("(wall-clock median, min, max; cpu: median CPU time of this process; "
                 "x goal: the wall-clock median over the goal, below 1 is within it)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="runs per measurement")
    parser.add_argument("--model", type=Path, help="also profile this checkpoint")
    args = parser.parse_args()
    rows = [measure_planner(args.runs), measure_refused_plan(args.runs)]
    if args.model is not None:
        rows.append(measure_profile(args.runs, args.model))
    print(render(rows))


if __name__ == "__main__":
    main()
