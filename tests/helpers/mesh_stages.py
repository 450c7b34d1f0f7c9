"""A pipeline whose stages are real stage workers, each one a tensor-parallel group of two
(issue 32's 2D mesh inside one host, without a daemon): a stage's ``stage`` worker (rank
0, its MXCL listener on 127.0.0.(2 + stage)) and its ``stage-tp-1`` worker (rank 1), both
started as the supervisor starts them (``python -m mlxceld.workers``, fed their
bootstrap, the cluster secret in it), in a state dir of the stage's own; the pipeline
engine in the test's process dials them as a coordinator's router would. ``tensor``
names the stages that are groups; the others are one ``stage`` worker.

Ended by pid: each rank 0 told to stop (SIGTERM: it drains, then closes its group, whose
follower exits 0), then anything left killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxceld.discovery.inventory import ring_ports
from mlxceld.models.identity import model_identity
from mlxceld.pipeline import PipelineEngine, StageAddress
from mlxceld.roles.options import StageOptions, StageTensorOptions
from mlxceld.supervisor.channel import call
from mlxceld.supervisor.ops import Health, Stats
from mlxceld.supervisor.process import WorkerSpec, child_environment
from mlxceld.types import JSON

from helpers.keys import keyring
from helpers.ports import free_port
from helpers.waiting import wait_for

SECRET = b"mesh-stages-test-secret-0123456789"
COORD = "127.0.0.1:19999"  # the engine's identity: the stages' coordinator
UP_S = 180.0  # every worker's imports, ring and load on a loaded 2-core machine
STOP_S = 30.0


@dataclass
class MeshStages:
    model: Path
    specs: dict[str, WorkerSpec]  # by "<stage>/<worker>", e.g. "1/stage-tp-1"
    procs: dict[str, subprocess.Popen[bytes]]
    stages: list[StageAddress]

    def engine(self, **knobs: Any) -> PipelineEngine:
        """A router's engine over the stages (``knobs``: ``PipelineEngine``'s, e.g.
        ``kv_quant``)."""
        return PipelineEngine(self.stages, keyring=keyring(SECRET), origin=COORD,
                              model_identity=model_identity(self.model), cluster="test",
                              model_id="m", context_length=4096, eos_token_ids=set(),
                              **knobs)

    def stats(self, key: str) -> JSON:
        """Worker ``key``'s stats (its control channel's ``stats``)."""
        reply = asyncio.run(call(self.specs[key].control_socket, Stats(), timeout_s=10.0))
        stats: JSON = reply["stats"]
        return stats

    def log(self, key: str) -> str:
        return self.specs[key].log_path.read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {k}\n{self.log(k)[-3000:]}" for k in self.specs)


def _ready(spec: WorkerSpec, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"worker {spec.name} exited {proc.returncode}:\n"
                             + spec.log_path.read_text(errors="replace")[-3000:])
    try:
        reply = asyncio.run(call(spec.control_socket, Health()))
    except Exception:
        return False
    return bool(reply.get("state") == "ready")


def _spawn(spec: WorkerSpec) -> subprocess.Popen[bytes]:
    for d in (spec.control_socket.parent, spec.log_path.parent):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    with spec.log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlxceld.workers", "--role", spec.role,
                                 "--name", spec.name], stdin=subprocess.PIPE, stdout=log,
                                stderr=log, cwd=spec.state_dir, env=child_environment(),
                                start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec.bootstrap()).encode())
    proc.stdin.close()
    return proc


def _specs(root: Path, model: Path, splits: Sequence[tuple[int, int]], tensor: set[int],
           draft: Path | None, k: int) -> tuple[dict[str, WorkerSpec], list[StageAddress]]:
    hosts = [f"127.0.0.{2 + i}" for i in range(len(splits))]
    addrs = [f"{h}:{free_port(h)}" for h in hosts]
    rings = iter(ring_ports("127.0.0.1", 2 * len(tensor)))
    specs: dict[str, WorkerSpec] = {}
    stages = []
    for i, layers in enumerate(splits):
        last, ring = i == len(splits) - 1, len(splits) > 1
        tp_hosts = tuple(f"127.0.0.1:{next(rings)}" for _ in range(2)) if i in tensor else ()
        state = root / f"s{i}"
        specs[f"{i}/stage"] = WorkerSpec("stage", state, StageOptions(
            model=str(model), layers=layers, node_id=f"stage-{i}", rank=i,
            address=addrs[i], coordinator=COORD, upstream=addrs[i - 1] if i else None,
            downstream=None if last else addrs[i + 1],
            first=addrs[0] if ring and last else None,
            last=addrs[-1] if ring and i == 0 else None,
            model_identity=model_identity(model), cluster="test",
            tp_size=len(tp_hosts) or 1, tp_hosts=tp_hosts,
            draft_model=str(draft) if draft is not None and last else None,
            num_draft_tokens=k), secret=SECRET)
        if tp_hosts:
            specs[f"{i}/stage-tp-1"] = WorkerSpec("stage-tp-1", state, StageTensorOptions(
                model=str(model), layers=layers, node_id=f"stage-{i}", rank=1,
                tp_hosts=tp_hosts))
        host, port = addrs[i].rsplit(":", 1)
        stages.append(StageAddress(f"stage-{i}", host, int(port), i, layers))
    return specs, stages


@contextlib.contextmanager
def mesh_stages(root: Path, model: Path, splits: Sequence[tuple[int, int]], *,
                tensor: set[int], draft: Path | None = None, k: int = 4
                ) -> Iterator[MeshStages]:
    """The stages of ``splits`` (those in ``tensor`` groups of two), ready; ``draft``: the
    last stage's draft model, ``k`` its proposals a pass."""
    specs, stages = _specs(root, model, splits, tensor, draft, k)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    mesh = MeshStages(model, specs, procs, stages)
    try:
        for key, spec in specs.items():
            procs[key] = _spawn(spec)
        for key, spec in specs.items():
            wait_for(lambda s=spec, p=procs[key]: _ready(s, p), UP_S,
                     f"worker {key} ready", every=0.5)
        yield mesh
    finally:
        for key, proc in procs.items():  # rank 0 first: its group closes
            if key.endswith("/stage") and proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def greedy_tokens(mesh: MeshStages, prompts: Sequence[list[int]], n: int, **knobs: Any
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` greedy tokens of each prompt through one engine (``knobs``: its own): one
    request after the other, then all of them at once."""
    from helpers.stages import tokens_of

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        engine = mesh.engine(**knobs)
        try:
            alone = [await tokens_of(engine, p, n) for p in prompts]
            together = await asyncio.gather(*(tokens_of(engine, p, n) for p in prompts))
            return alone, list(together)
        finally:
            await engine.aclose()

    return asyncio.run(run())


def sampled_tokens(mesh: MeshStages, prompt: list[int], n: int, temperature: float
                   ) -> list[int]:
    """``n`` tokens of ``prompt`` sampled at ``temperature``."""
    from mlxceld.engine import GenerationRequest, SamplingParams

    async def run() -> list[int]:
        engine = mesh.engine()
        try:
            req = GenerationRequest("s", prompt, SamplingParams(max_tokens=n,
                                                                temperature=temperature))
            return [t.token async for t in engine.generate(req)]
        finally:
            await engine.aclose()

    return asyncio.run(run())


__all__ = ["MeshStages", "greedy_tokens", "mesh_stages", "sampled_tokens"]
