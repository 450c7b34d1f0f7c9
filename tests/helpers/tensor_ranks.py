"""Real tensor-parallel ranks for the tests: each rank a process of its own on loopback.

``python tests/helpers/tensor_ranks.py SPEC_JSON`` runs one rank. The spec: ``rank``,
``hosts`` (each rank's ``127.0.0.1:port``), ``model`` (a checkpoint directory),
``max_batch``, and for rank 0 ``requests`` (each ``{"prompt": [ids], "max_tokens": n}``
plus any ``SamplingParams`` field) and ``out`` (a file: every request's tokens and
log-probabilities as JSON, all requests run at once, batched), then ``rounds`` more times
the same (the prompt cache in play). Rank 0 closes the group when done; the others return.

``start_ranks`` starts them all and ``finish`` waits for them (each ended by pid).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
DEADLINE_S = 240.0  # a rank's whole run, loads included, on a loaded 2-core machine


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_ranks(model: Path, size: int, requests: list[dict[str, Any]], out: Path, *,
                max_batch: int = 4, rounds: int = 1) -> list[subprocess.Popen[bytes]]:
    hosts = [f"127.0.0.1:{p}" for p in free_ports(size)]
    procs = []
    for rank in range(size):
        spec = {"rank": rank, "hosts": hosts, "model": str(model), "max_batch": max_batch,
                "requests": requests, "out": str(out), "rounds": rounds}
        procs.append(subprocess.Popen([sys.executable, str(HERE), json.dumps(spec)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def finish(procs: list[subprocess.Popen[bytes]], deadline_s: float = DEADLINE_S
           ) -> list[tuple[int, str]]:
    """Each rank's exit code and output; every rank still running at the deadline is
    killed by pid."""
    end = time.monotonic() + deadline_s
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            out, _ = p.communicate()
        results.append((p.returncode, out.decode(errors="replace")))
    return results


def _main(spec: dict[str, Any]) -> int:
    from mlxceld.engine.base import GenerationRequest, SamplingParams
    from mlxceld.engine.tensor import join_ring, load_tensor_engine, run_tensor_follower

    group = join_ring(spec["rank"], spec["hosts"])
    if spec["rank"] > 0:
        run_tensor_follower(spec["model"], group, max_batch=spec["max_batch"])
        return 0
    engine, _ = load_tensor_engine(spec["model"], group, max_batch=spec["max_batch"])

    async def one(i: int, r: dict[str, Any]) -> dict[str, Any]:
        fields = {k: v for k, v in r.items() if k != "prompt"}
        req = GenerationRequest(f"r{i}", r["prompt"], SamplingParams(**fields))
        tokens, logprobs = [], []
        async for out in engine.generate(req):
            tokens.append(out.token)
            logprobs.append(out.logprob)
        return {"tokens": tokens, "logprobs": logprobs}

    async def run() -> list[list[dict[str, Any]]]:
        rounds = []
        for _ in range(spec["rounds"]):
            rounds.append(list(await asyncio.gather(
                *(one(i, r) for i, r in enumerate(spec["requests"])))))
        await engine.aclose()
        return rounds

    results = asyncio.run(run())
    Path(spec["out"]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent.parent))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(_main(json.loads(sys.argv[1])))
