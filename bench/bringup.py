"""Zero-config bring-up, measured: how long each part takes against its goal.

One function per measurement, each returning a ``Row``; ``main`` prints them
as one table with the ratio to the goal (below 1 is within it) and the CPU time,
which other load on the machine does not move. So far:

- planner: ``plan_stages`` for 100 nodes of mixed memory (16-80 GiB) and a
  200-layer model, the median of ``--runs`` runs (goal: well under a second);
- planner, refused: the same when nothing fits (the closest split and the
  per-node shortfall message);
- profile (with ``--model DIR``): ``layer_profile`` of a real checkpoint, which
  reads its safetensors headers only;
- fixture: ``write_fixture`` of the ``tiny`` (goal: 1 s) and ``small`` (goal:
  10 s) presets then ``mlx_lm.load`` of what it wrote, as `make run` without
  ``MODEL`` does first (3 runs at most);
- two-phase assignment: ``assignment.push`` from a coordinator to ``--peers``
  (32) simulated peers, from the first offer to every stage active (goal: 2 s).
  Each peer is the real thing but its stage: an ``AgentService`` listening on
  its own 127.0.0.x (the coordinator dials from 127.0.0.1), the real
  ``Assignee`` (``PeerRound``) voting and recording in its own SQLite file,
  and a ``StageHost`` whose stage "prepares" at once (no model, no worker).
  Coordinator and peers share this process and its event loop, so its CPU
  time is theirs together.

    .venv/bin/python bench/bringup.py [--runs 9] [--peers 32] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlxceld import __version__
from mlxceld.cluster.assignment.coordinator_round import Finished
from mlxceld.cluster.assignment.offers import PeerFacts
from mlxceld.cluster.assignment.peer import Assignee
from mlxceld.cluster.assignment.push import PushPlan, StageOffer, push
from mlxceld.cluster.plan.solver import PlanNode, PlanRefused, plan_stages
from mlxceld.models.profile import LayerProfile, layer_profile
from mlxceld.net.agent import AgentService
from mlxceld.state.db import open_db
from mlxceld.state.events import EventLog
from mlxceld.state.plans import Assignments, Plans
from mlxceld.wire import Keyring

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


def measure_fixture(runs: int, name: str, goal: float) -> Row:
    import mlx_lm

    from mlxceld.models import preset, write_fixture

    with tempfile.TemporaryDirectory(prefix="mxfix") as root:
        def write_and_load() -> None:
            directory = Path(root) / name
            shutil.rmtree(directory, ignore_errors=True)
            mlx_lm.load(str(write_fixture(directory, preset(name))))

        return Row(f"fixture {name}: write and load", *timed(runs, write_and_load), goal=goal)


CLUSTER, MODEL_IDENTITY = "bench-cluster", "be" * 32
LAYERS_PER_STAGE = 2


@dataclass
class InstantStage:
    """A peer's ``StageHost`` with no model: prepare, activate and stop take no time."""

    host: str
    layers: int
    state: str = "none"  # none | standby | active
    calls: list[str] = field(default_factory=list)

    def facts(self, port: int) -> PeerFacts:
        return PeerFacts(__version__, CLUSTER, MODEL_IDENTITY, self.layers, self.host,
                         frozenset({port}), model_family="llama")

    async def prepare_stage(self, epoch: int, node_id: str, toml: str) -> None:
        self.calls.append(f"prepare {node_id}")
        self.state = "standby"

    async def activate_stage(self) -> None:
        self.calls.append("activate")
        self.state = "active"

    async def stop_stage(self) -> None:
        self.calls.append("stop")
        self.state = "none"


@dataclass(frozen=True)
class PushResult:
    seconds: float  # from the first offer to every stage active (or the abort)
    cpu: float
    finished: Finished
    peer_states: list[str]  # each peer's recorded state for the epoch
    stage_states: list[str]  # each InstantStage's state


def cluster_toml(coordinator: str, stages: list[tuple[str, int]]) -> str:
    """The cluster TOML a coordinator would push: ``stages`` as (host, port), in rank order."""
    lines = ["[cluster]", f'name = "{CLUSTER}"', f"pipeline_parallel_size = {len(stages)}",
             "", "[[nodes]]", 'id = "coordinator"', f'address = "{coordinator}"',
             'role = "coordinator"']
    for rank, (host, port) in enumerate(stages):
        start = rank * LAYERS_PER_STAGE
        lines += ["", "[[nodes]]", f'id = "stage-{rank}"', f'address = "{host}:{port}"',
                  'role = "pipeline_stage"', f"rank = {rank}",
                  f"layers = [{start}, {start + LAYERS_PER_STAGE}]"]
    return "\n".join(lines) + "\n"


async def simulated_push(peers: int, root: Path) -> PushResult:
    """One push to ``peers`` in-process peers (127.0.0.2 onwards) over MXCL on loopback."""
    keyring = Keyring()
    keyring.add(secrets.token_bytes(32), primary=True)
    layers = peers * LAYERS_PER_STAGE
    hosts = [f"127.0.{i // 250}.{i % 250 + 2}" for i in range(peers)]
    stages = [InstantStage(h, layers) for h in hosts]
    agents = [AgentService((h, 0), keyring) for h in hosts]
    dbs = [open_db(root / f"peer-{i}.db") for i in range(peers)]
    assignees = [Assignee(Assignments(db), stage, keyring,
                          identity=functools.partial(getattr, a, "address"), state_dir=root,
                          enabled=True, events=EventLog(db))
                 for db, stage, a in zip(dbs, stages, agents, strict=True)]
    async with asyncio.TaskGroup() as tg:
        try:
            for a, assignee in zip(agents, assignees, strict=True):
                assignee.register(a)
                started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                tg.create_task(a.run(started))
                await started
                tg.create_task(assignee.run())
            coordinator = "127.0.0.1:19000"  # it dials only; no peer asks it anything here
            placed = [(h, 19100) for h in hosts]
            plan = PushPlan(CLUSTER, MODEL_IDENTITY, cluster_toml(coordinator, placed),
                            tuple(StageOffer(a.address, rank, (rank * LAYERS_PER_STAGE,
                                                               (rank + 1) * LAYERS_PER_STAGE),
                                             f"stage-{rank}", port)
                                  for rank, (a, (_, port)) in enumerate(zip(agents, placed,
                                                                            strict=True))))
            plans = Plans(open_db(root / "coordinator.db"))
            start, start_cpu = time.perf_counter(), time.process_time()
            _, done = await push(plan, plans=plans, keyring=keyring, identity=coordinator)
            seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            rows = [a.describe() or {} for a in assignees]
            return PushResult(seconds, cpu, done, [str(r.get("state")) for r in rows],
                              [s.state for s in stages])
        finally:
            for assignee in assignees:
                assignee.close()
            for a in agents:
                await a.aclose()


def measure_push(runs: int, peers: int) -> Row:
    wall, cpu = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="mxbench") as tmp:
            r = asyncio.run(simulated_push(peers, Path(tmp)))
        if not r.finished.ok or set(r.peer_states) != {"active"}:
            raise AssertionError(f"the push did not end active: {r.finished.summary}")
        wall.append(r.seconds)
        cpu.append(r.cpu)
    return Row(f"2PC offer to all active, {peers} peers", wall, cpu, goal=2.0)


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
    parser.add_argument("--peers", type=int, default=32, help="simulated peers of the 2PC")
    parser.add_argument("--model", type=Path, help="also profile this checkpoint")
    args = parser.parse_args()
    rows = [measure_planner(args.runs), measure_refused_plan(args.runs),
            measure_push(args.runs, args.peers)]
    if args.model is not None:
        rows.append(measure_profile(args.runs, args.model))
    rows += [measure_fixture(min(args.runs, 3), "tiny", 1.0),
             measure_fixture(min(args.runs, 3), "small", 10.0)]
    print(render(rows))


if __name__ == "__main__":
    main()
