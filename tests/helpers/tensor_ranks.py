"""Real tensor-parallel ranks for the tests: each rank a process of its own on loopback.

``python tests/helpers/tensor_ranks.py SPEC_JSON`` runs one rank. The spec: ``rank``,
``hosts`` (each rank's ``127.0.0.1:port``), ``model`` (a checkpoint directory),
``max_batch``, and for rank 0 ``requests`` (each ``{"prompt": [ids], "max_tokens": n}``
plus any ``SamplingParams`` field, and ``cancel_after``: close its stream after that many
tokens) and ``out`` (a file: every request's tokens and log-probabilities as JSON, all
requests run at once, batched), ``rounds`` times (the prompt cache in play from the
second); ``OUT.started`` is made at the first token. With ``idle_s`` it then makes
``OUT.idle``, idles that long and runs the first request once more. With ``handoff`` it
then tries a KV-handoff prefill and writes its refusal. ``share_deadline_s``: the ranks'.
``kv`` (rank 0's only: its setup op tells the others): a quantized KV cache,
``{"bits", "group_size", "start"}`` (``roles.options.KVQuant``). ``draft`` (rank 0's
only): a draft model's directory (speculative decoding, ``num_draft_tokens`` 4); the
out file then has its counters (``speculation``). ``orders`` instead of ``rounds``: a
round per item, ``"all"`` (every request at once) or ``"one"`` (one after another:
each alone in the engine, so each speculates).
Rank 0 closes the group when done; the others return.

``start_ranks`` starts them all and ``finish`` waits for them (each ended by pid).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlxceld.discovery.inventory import ring_ports

HERE = Path(__file__).resolve()
DEADLINE_S = 240.0  # a rank's whole run, loads included, on a loaded 2-core machine


def start_ranks(model: Path, size: int, requests: list[dict[str, Any]], out: Path, *,
                max_batch: int = 4, rounds: int = 1, handoff: bool = False,
                **more: Any) -> list[subprocess.Popen[bytes]]:
    """Every rank of a group of ``size`` (the spec in the module docstring; ``more``: its
    other keys, ``idle_s``, ``share_deadline_s``)."""
    hosts = [f"127.0.0.1:{p}" for p in ring_ports("127.0.0.1", size)]
    procs = []
    for rank in range(size):
        spec = {"rank": rank, "hosts": hosts, "model": str(model), "max_batch": max_batch,
                "requests": requests, "out": str(out), "rounds": rounds,
                "handoff": handoff, **more}
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


async def generated(engine: Any, i: int, r: dict[str, Any], started: Path | None = None
                    ) -> dict[str, Any]:
    """Request ``r`` on ``engine``: its tokens and log-probabilities."""
    from mlxceld.engine.base import GenerationRequest, SamplingParams

    fields = {k: v for k, v in r.items() if k not in ("prompt", "cancel_after")}
    if "logit_bias" in fields:
        fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields["logit_bias"])
    req = GenerationRequest(f"r{i}", r["prompt"], SamplingParams(**fields))
    tokens, logprobs = [], []
    async for out in engine.generate(req):
        tokens.append(out.token)
        logprobs.append(out.logprob)
        if started is not None:
            started.touch()
        if len(tokens) == r.get("cancel_after"):
            break
    return {"tokens": tokens, "logprobs": logprobs}


def _main(spec: dict[str, Any]) -> int:
    from mlxceld.engine.base import EngineError, GenerationRequest, SamplingParams
    from mlxceld.engine.tensor import join_ring, load_tensor_engine, run_tensor_follower

    group = join_ring(spec["rank"], spec["hosts"])
    if spec["rank"] > 0:
        run_tensor_follower(spec["model"], group, max_batch=spec["max_batch"],
                            share_deadline_s=spec.get("share_deadline_s", 60.0))
        return 0
    from mlxceld.roles.options import KVQuant

    kv = spec.get("kv")
    engine, _ = load_tensor_engine(spec["model"], group, max_batch=spec["max_batch"],
                                   share_deadline_s=spec.get("share_deadline_s", 60.0),
                                   kv_quant=None if kv is None else KVQuant(**kv),
                                   draft_model=spec.get("draft"))

    started = Path(spec["out"] + ".started")

    async def run() -> dict[str, Any]:
        rounds = []
        for order in spec.get("orders") or ["all"] * spec["rounds"]:
            jobs = [generated(engine, i, r, started) for i, r in enumerate(spec["requests"])]
            rounds.append(list(await asyncio.gather(*jobs)) if order == "all"
                          else [await job for job in jobs])
        if spec.get("idle_s"):  # then one more request: whether the engine still serves
            Path(spec["out"] + ".idle").touch()
            await asyncio.sleep(spec["idle_s"])
            rounds.append([await generated(engine, 0, spec["requests"][0])])
        refused = None
        if spec.get("handoff"):
            try:
                await engine.prefill(GenerationRequest("h", [1, 2], SamplingParams(4)))
            except EngineError as exc:
                refused = str(exc)
        await engine.aclose()
        counters = None if engine.draft is None else engine.draft.snapshot()
        return {"rounds": rounds, "handoff": refused, "speculation": counters}

    results = asyncio.run(run())
    Path(spec["out"]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # as a worker exits (workers/runtime.exit_at_once): no interpreter teardown, which a
    # thread's mlx streams ending at the same time can abort (SIGABRT)
    from mlxceld.workers.runtime import exit_at_once

    exit_at_once(_main(json.loads(sys.argv[1])))
