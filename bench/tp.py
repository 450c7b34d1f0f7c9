"""Tensor parallelism (``mlxceld/engine/tensor.py``): a model split over ``--tp`` rank
processes on this host against the same model whole in one process, in one run.

The ``small`` fixture (qwen3, 8 layers, hidden 512, 8 heads, 4 KV heads) by default. Each
setup runs in processes of its own (one process; ``--tp`` ranks in an ``mx.distributed``
ring over loopback), so that their memory compares: each engine process runs ``--rounds``
rounds of ``--streams`` greedy requests at once (a prompt of ``--prompt`` random token
ids, ``--new`` tokens each; the prompt differs per round, so no prompt cache helps), and
reports per round the time to the first token and the decode rate (tokens after the first,
over the time after the first). Every process then reports its resident set (RSS, and
its peak), what of it is above its baseline (its RSS with mlx and mlx-lm imported, before
the model: about 90 MiB here, which every rank pays), anonymous and file-backed, what
joining the ring added (mlx's ring backend's buffers: about 32 MiB a rank here, whatever
the model), mlx's own account (its live arrays, the freed buffers it keeps, its peak), and
the bytes of weights it holds. The setups alternate ``--repeat`` times; medians are
printed, with the ratios tp / one.

On a 2-core machine no decode speed-up is expected (two ranks share the two cores with
each other and the collectives: 2 ``all_sum``s per layer per step, each ~0.6 ms over
loopback); the prefill, one large matmul per weight, does gain from two processes on two
cores. What tensor parallelism buys is memory: each rank holds 1/N of the layers' weights
(the embedding and the head stay whole on every rank), and pays the ring's fixed buffers,
which on this 49 MiB fixture eat most of that saving and on a model of gigabytes are
noise.

    .venv/bin/python bench/tp.py [--tp 2] [--preset small] [--prompt 256] [--new 64]
                                 [--streams 1] [--rounds 3] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlxceld.discovery.inventory import free_ports

HERE = Path(__file__).resolve()
DEADLINE_S = 1800.0  # one setup's processes, loads included


def _memory() -> dict[str, int]:
    """This process's RSS and peak RSS (Linux: VmHWM), and mlx's own account: the bytes
    of its live arrays (``active``), the freed buffers it keeps for reuse (``cache``) and
    its peak of live arrays (``mlx_peak``)."""
    import mlx.core as mx
    import psutil
    out = {"rss": psutil.Process().memory_info().rss, "peak": 0,
           "active": mx.get_active_memory(), "cache": mx.get_cache_memory(),
           "mlx_peak": mx.get_peak_memory()}
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["peak"] = int(line.split()[1]) * 1024
            elif line.startswith(("RssAnon:", "RssFile:")):
                out[line.split(":")[0].lower()] = int(line.split()[1]) * 1024
    return out


def _worker(spec: dict[str, Any]) -> None:
    """One process of a setup: rank -1 (the model whole), 0 (the engine of a group), or a
    follower. Prints one JSON line: its timings (an engine) and memory."""
    import mlx_lm  # noqa: F401  (imported before the baseline is measured)

    from mlxceld.engine.base import GenerationRequest, SamplingParams
    from mlxceld.engine.loading import load_local_engine
    from mlxceld.engine.tensor import join_ring, load_tensor_engine, run_tensor_follower
    from mlxceld.models.reading import parameter_bytes

    rank = spec["rank"]
    before = _memory()  # the interpreter, mlx and mlx-lm imported: no model yet
    base = before["rss"]
    bases = {"base_anon": before.get("rssanon", 0), "base_file": before.get("rssfile", 0)}
    held: list[int] = []
    if rank > 0:
        group = join_ring(rank, spec["hosts"])
        bases["ring"] = _memory()["rss"] - base  # the ring's buffers, before any weight
        loaded: dict[str, int] = {}
        run_tensor_follower(spec["model"], group, max_batch=spec["streams"],
                            ready=lambda: loaded.update(_memory()))
        # Its RSS with the model loaded (it is freed once the group closes), its peak now.
        print(json.dumps({**loaded, **bases, "rank": rank, "base": base,
                          "peak": _memory()["peak"]}), flush=True)
        return
    if rank == 0:
        group = join_ring(0, spec["hosts"])
        bases["ring"] = _memory()["rss"] - base
        engine, _ = load_tensor_engine(spec["model"], group, max_batch=spec["streams"])
    else:
        engine, _ = load_local_engine(spec["model"], max_batch=spec["streams"])
    held.append(parameter_bytes(engine._gen.model.parameters()))
    rng = random.Random(7)

    async def one(prompt: list[int]) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        req = GenerationRequest("b", prompt, SamplingParams(spec["new"], temperature=0))
        async for _ in engine.generate(req):
            n += 1
            last = time.perf_counter()
            if n == 1:
                first = last
        return first - t0, (n - 1) / (last - first) if n > 1 and last > first else 0.0

    async def run() -> list[tuple[float, float]]:
        rounds = []
        for _ in range(spec["rounds"]):
            prompts = [[rng.randrange(3, 250) for _ in range(spec["prompt"])]
                       for _ in range(spec["streams"])]
            got = await asyncio.gather(*(one(p) for p in prompts))
            rounds.append((statistics.median(t for t, _ in got), sum(r for _, r in got)))
        memory = _memory()
        await engine.aclose()
        memory["peak"] = max(memory["peak"], _memory()["peak"])
        print(json.dumps({**bases, "rank": rank, "rounds": rounds, "weights": held[0],
                          "base": base, **memory}), flush=True)
        return rounds

    asyncio.run(run())


def _setup(model: Path, tp: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run one setup (tp 1: the model whole in one process) to its end; each process's
    report, rank 0 (or the only one) first."""
    hosts = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", tp)] if tp > 1 else []
    ranks = range(tp) if tp > 1 else [-1]
    procs = []
    for rank in ranks:
        spec = {"rank": rank, "hosts": hosts, "model": str(model), "streams": args.streams,
                "prompt": args.prompt, "new": args.new, "rounds": args.rounds}
        procs.append(subprocess.Popen([sys.executable, str(HERE), "--worker", json.dumps(spec)],
                                      stdout=subprocess.PIPE, text=True))
    reports = []
    end = time.monotonic() + DEADLINE_S
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            if p.returncode != 0:
                raise SystemExit(f"a process of the tp {tp} setup exited {p.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return reports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from mlxceld.workers.runtime import exit_at_once
        _worker(json.loads(args.worker))
        # as a worker does: mlx's native threads can abort the interpreter's teardown
        # ("terminate called without an active exception"), after the report was printed
        exit_at_once(0)

    from mlxceld.models import fixture_cache, preset
    model = fixture_cache(preset(args.preset))
    print(f"model {args.preset} ({model}); prompt {args.prompt} tokens, {args.new} new, "
          f"{args.streams} stream(s), {args.rounds} rounds per process, {args.repeat} "
          f"processes per setup, alternating", flush=True)
    ttft: dict[int, list[float]] = {1: [], args.tp: []}
    rate: dict[int, list[float]] = {1: [], args.tp: []}
    memory: dict[int, list[dict[str, Any]]] = {1: [], args.tp: []}
    for _ in range(args.repeat):
        for tp in (1, args.tp):
            reports = _setup(model, tp, args)
            ttft[tp] += [t for t, _ in reports[0]["rounds"]]
            rate[tp] += [r for _, r in reports[0]["rounds"]]
            memory[tp] = reports
            print(f"  tp {tp}: TTFT {[round(t * 1000) for t, _ in reports[0]['rounds']]} "
                  f"ms, decode {[round(r, 1) for _, r in reports[0]['rounds']]} tok/s",
                  flush=True)

    mib = 1 << 20
    print("\n| setup | TTFT ms (median) | decode tok/s (median) | per process: RSS MiB "
          "(peak), above its baseline (anonymous, file-backed; joining the ring) "
          "| per process: mlx active / cache / peak MiB | weights MiB |")
    print("|---|---|---|---|---|---|")
    for tp in (1, args.tp):
        def who(r: dict[str, Any], tp: int = tp) -> str:
            return f"rank {r['rank']}" if tp > 1 else "one process"

        procs = "; ".join(
            f"{who(r)} {r['rss'] / mib:.0f} ({r['peak'] / mib:.0f}), "
            f"+{(r['rss'] - r['base']) / mib:.0f} (anon "
            f"+{(r.get('rssanon', 0) - r['base_anon']) / mib:.0f}, file "
            f"+{(r.get('rssfile', 0) - r['base_file']) / mib:.0f}"
            + (f"; its ring +{r['ring'] / mib:.0f}" if "ring" in r else "") + ")"
            for r in memory[tp])
        mlx = "; ".join(f"{who(r)} {r['active'] / mib:.0f} / {r['cache'] / mib:.0f} / "
                        f"{r['mlx_peak'] / mib:.0f}" for r in memory[tp])
        print(f"| {'one process' if tp == 1 else f'tp {tp}'} "
              f"| {statistics.median(ttft[tp]) * 1000:.0f} "
              f"| {statistics.median(rate[tp]):.1f} | {procs} | {mlx} "
              f"| {memory[tp][0]['weights'] / mib:.1f} |")
    one_rss = memory[1][0]["rss"] - memory[1][0]["base"]
    above = ", ".join(f"{(r['rss'] - r['base']) / one_rss:.2f}" for r in memory[args.tp])
    less_ring = ", ".join(f"{(r['rss'] - r['base'] - r['ring']) / one_rss:.2f}"
                          for r in memory[args.tp])
    print(f"\nratios tp {args.tp} / one process: TTFT "
          f"{statistics.median(ttft[args.tp]) / statistics.median(ttft[1]):.2f}, decode "
          f"{statistics.median(rate[args.tp]) / statistics.median(rate[1]):.2f}, RSS above the "
          f"baseline per rank {above} (less its ring's buffers {less_ring}), weights per rank "
          f"{memory[args.tp][0]['weights'] / memory[1][0]['weights']:.2f}")


if __name__ == "__main__":
    main()
