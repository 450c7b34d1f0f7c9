"""Plans that weigh speed, predicted: one model over two hosts of unequal speed, split by
memory (today's rule) and by speed, with each stage's predicted time per token.

A stage's time per token is its weight bytes over its host's compute units (GB/s of
weights through a decode-shaped matmul, ``mlxceld/models/speed.py``). Two numbers per
plan: the bottleneck (the slowest stage: what bounds tokens per second with several
sequences in flight) and the sum (one sequence alone: each token crosses every stage).
The default hosts are a big slow one (64 GiB, 20 units) and a small fast one (32 GiB,
60 units); the default model is a 7B-sized bfloat16 checkpoint's profile (32 layers of
386 MiB, 250 MiB embeddings and head), or ``--model DIR``'s own. ``--measure`` also
measures this host's units in bfloat16 (the daemon's benchmark) and the planner's time
for 100 nodes of mixed speed and a 200-layer model.

These are predictions, not a decode measurement: ``bench/plan_speed_measured.py``
decodes through both plans on two daemons held to unequal CPU.

    .venv/bin/python bench/plan_speed.py [--model DIR] [--memory 64,32] [--units 20,60]
                                         [--measure]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mlxceld.cluster.plan.model import Plan
from mlxceld.cluster.plan.solver import PlanNode, plan_stages
from mlxceld.models.profile import LayerProfile, layer_profile
from mlxceld.models.speed import measure_units

GIB, MIB = 1 << 30, 1 << 20


def seven_b() -> LayerProfile:
    return LayerProfile(layer_bytes=(386 * MIB,) * 32, embed_bytes=250 * MIB,
                        head_bytes=250 * MIB, norm_bytes=8192, other_bytes=0, tied=False,
                        dtype_bytes=2, hidden_size=4096, kv_bytes_per_token=2 * 1024 * 2)


def report(name: str, plan: Plan, units: list[float]) -> tuple[float, float]:
    """Print ``plan``'s stages with their times at ``units``; (bottleneck, sum) in ms."""
    times = [s.weight_bytes / (u * 1e6) for s, u in zip(plan.stages, units, strict=True)]
    print(f"{name} (split {plan.stages[0].split_rule}):")
    for s, u, ms in zip(plan.stages, units, times, strict=True):
        print(f"  {s.stage_id} on {s.node.node_id:<5} layers [{s.layers[0]:>3}, "
              f"{s.layers[1]:>3})  {s.weight_bytes / GIB:6.2f} GiB  {u:6.1f} units  "
              f"{ms:7.1f} ms/token")
    worst, total = max(times), sum(times)
    print(f"  bottleneck {worst:.1f} ms ({1000 / worst:.2f} tok/s pipelined); one sequence "
          f"{total:.1f} ms ({1000 / total:.2f} tok/s)")
    return worst, total


def planner_time() -> float:
    """Seconds for ``plan_stages`` by speed: 100 nodes (16-80 GiB, 10-50 units), 200 layers."""
    nodes = [PlanNode(f"n{i}", f"10.0.{i // 200}.{i % 200 + 1}:19000",
                      (16 + 16 * (i % 5)) * GIB, 19100, 10.0 + 10 * (i % 5))
             for i in range(100)]
    p = LayerProfile(layer_bytes=(GIB,) * 200, embed_bytes=GIB, head_bytes=GIB, norm_bytes=0,
                     other_bytes=0, tied=False, dtype_bytes=2, hidden_size=8192,
                     kv_bytes_per_token=4096)
    started = time.process_time()
    plan = plan_stages(p, 100, nodes)
    assert plan.stages[0].split_rule == "speed"
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a checkpoint to price (default: 7B)")
    parser.add_argument("--memory", default="64,32", help="each host's usable GiB")
    parser.add_argument("--units", default="20,60", help="each host's compute units")
    parser.add_argument("--measure", action="store_true",
                        help="also measure this host's units and the planner's time")
    args = parser.parse_args()
    memory = [float(m) for m in args.memory.split(",")]
    units = [float(u) for u in args.units.split(",")]
    if len(memory) != len(units) or len(memory) < 2:
        parser.error("--memory and --units name the same hosts, two or more")
    profile = layer_profile(args.model) if args.model else seven_b()
    names = [chr(ord("a") + i) for i in range(len(memory))]
    bare = [PlanNode(n, f"10.0.0.{i + 1}:19000", int(m * GIB), 19100)
            for i, (n, m) in enumerate(zip(names, memory, strict=True))]
    timed = [PlanNode(n.node_id, n.address, n.memory_usable_bytes, 19100, u)
             for n, u in zip(bare, units, strict=True)]
    by_memory = report("by memory", plan_stages(profile, len(bare), bare), units)
    by_speed = report("by speed", plan_stages(profile, len(timed), timed), units)
    print(f"speed over memory: bottleneck {by_memory[0] / by_speed[0]:.2f}x faster, one "
          f"sequence {by_memory[1] / by_speed[1]:.2f}x faster")
    if args.measure:
        print(f"this host: {measure_units('bfloat16'):.3g} compute units in bfloat16")
        print(f"planner by speed, 100 nodes x 200 layers: {planner_time():.3f} s CPU")


if __name__ == "__main__":
    main()
