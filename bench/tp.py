"""Tensor parallelism (``mlxceld/engine/tensor.py``): a model split over ``--tp`` ranks
on this host, behind one daemon, and over ``--tp`` daemons on their own IPs (a group
across hosts), against the same model whole in one process, in one run.

The ``small`` fixture (qwen3, 8 layers, hidden 512, 8 heads, 4 KV heads) by default. Four
setups, each in processes of its own, started afresh for every run:

- ``one process``: the model whole, mlxceld's engine in a process of the bench's;
- ``tp N``: ``--tp`` such processes in an ``mx.distributed`` ring over 127.0.0.1, rank 0
  driving the engine (``load_tensor_engine``; the others ``run_tensor_follower``);
- ``tp N, one daemon``: ``mlxceld --tp-size N`` on one host, as a user runs it: its
  router worker is rank 0, its ``tp-1`` .. workers the others; asked on its OpenAI port;
- ``tp N across hosts``: rank 0's daemon on 127.0.0.2 with ``--tp-size N --tp-peers``,
  each other rank a daemon (``--node-role tensor_parallel_rank``) on 127.0.0.3, ...:
  own state dirs, one cluster secret file (0600), the ring over those IPs
  (``bench/tp_hosts.py``, which also ends every process by pid, on failure too).

Each run sends ``--rounds`` rounds of ``--streams`` greedy requests at once (texts of
about ``--prompt`` tokens drawn from the model's vocabulary with a fixed seed, the same
in every setup and run, different per round and stream, so that no prompt cache helps;
``--new`` tokens each, ``ignore_eos``), and takes per round the time to the first token
and the decode rate (tokens after the first, over the time after the first): in the
engine for the first two setups, from the streamed SSE for the daemons'. The greedy
tokens must be the same in every setup and run (token ids between the in-process
setups, the text as the OpenAI port streams it for the daemons'): the bench says so, or
fails (exit 1) naming the first that differs. In-process, every process reports its
resident set (RSS, and its peak), what of it is above its baseline (its RSS with mlx and
mlx-lm imported, before the model: about 90 MiB here, which every rank pays), anonymous
and file-backed, what joining the ring added (mlx's ring backend's buffers: about 32 MiB
a rank here, whatever the model), mlx's own account (its live arrays, the freed buffers
it keeps, its peak), and the bytes of weights it holds; of the daemons' workers, RSS and
its peak read from outside, and the cores each daemon and worker kept busy. The setups
alternate ``--repeat`` times; medians are printed, with the ratios tp / one process and
across hosts / one process, / tp in one host and / tp behind one daemon. Last, where a
decode step's time goes: each setup's ms a step over the one before it, and one
``all_sum`` of a step's activations timed alone in a ring of two processes on 127.0.0.1
and on 127.0.0.2 and .3 (a step makes 2 a layer, and one for the sampled tokens).

On a 2-core machine no decode speed-up is expected (two ranks share the two cores with
each other and the collectives; mlx's ring busy-polls a core while a rank waits in one);
the prefill, one large matmul per weight, can gain from two processes on two cores.
Across hosts on one machine, the IPs are loopback's too: the ring costs what it costs
on 127.0.0.1, and what the group across hosts adds over tp in one process is rank 0
behind a daemon (the OpenAI port, SSE, the detokenizer), which the ``one daemon`` setup
shows apart. What tensor parallelism buys is memory: each rank holds 1/N of the layers'
weights (the embedding and the head stay whole on every rank), and pays the ring's fixed
buffers, which on this 49 MiB fixture eat most of that saving and on a model of
gigabytes are noise.

    .venv/bin/python bench/tp.py [--tp 2] [--preset small] [--prompt 256] [--new 64]
                                 [--streams 1] [--rounds 3] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
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

    from mlxceld.api.codec import MlxTextCodec
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
        engine, tokenizer = load_tensor_engine(spec["model"], group,
                                               max_batch=spec["streams"])
    else:
        engine, tokenizer = load_local_engine(spec["model"], max_batch=spec["streams"])
    held.append(parameter_bytes(engine._gen.model.parameters()))
    codec = MlxTextCodec(tokenizer)  # the OpenAI port's: its prompt ids, its streamed text

    async def one(text: str) -> tuple[float, float, list[int], str]:
        t0 = time.perf_counter()
        first = last = 0.0
        tokens: list[int] = []
        decoder = codec.decoder()
        params = SamplingParams(spec["new"], temperature=0, ignore_eos=True)
        req = GenerationRequest("b", codec.encode_prompt(text), params)
        async for out in engine.generate(req):
            tokens.append(out.token)
            last = time.perf_counter()
            if len(tokens) == 1:
                first = last
        n = len(tokens)
        text = "".join(decoder.add(t) for t in tokens) + decoder.finish()
        return (first - t0, (n - 1) / (last - first) if n > 1 and last > first else 0.0,
                tokens, text)

    async def run() -> None:
        rounds, tokens, texts = [], [], []
        for prompts in spec["prompts"]:
            got = await asyncio.gather(*(one(p) for p in prompts))
            rounds.append((statistics.median(g[0] for g in got), sum(g[1] for g in got)))
            tokens.append([g[2] for g in got])
            texts.append([g[3] for g in got])
        memory = _memory()
        await engine.aclose()
        memory["peak"] = max(memory["peak"], _memory()["peak"])
        print(json.dumps({**bases, "rank": rank, "rounds": rounds, "weights": held[0],
                          "base": base, "tokens": tokens, "texts": texts, **memory}),
              flush=True)

    asyncio.run(run())


def _setup(model: Path, tp: int, args: argparse.Namespace,
           prompts: list[list[str]]) -> list[dict[str, Any]]:
    """Run one setup (tp 1: the model whole in one process) to its end; each process's
    report, rank 0 (or the only one) first."""
    hosts = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", tp)] if tp > 1 else []
    ranks = range(tp) if tp > 1 else [-1]
    procs = []
    for rank in ranks:
        spec = {"rank": rank, "hosts": hosts, "model": str(model), "streams": args.streams,
                "new": args.new, "prompts": prompts}
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


def _prompts(model: Path, args: argparse.Namespace) -> list[list[str]]:
    """``--rounds`` x ``--streams`` texts of about ``--prompt`` tokens: words of the
    model's vocabulary drawn with a fixed seed, the same for every setup (text, since the
    OpenAI port takes no token ids; each engine encodes them as that port does). They
    differ per round and stream, so that no prompt cache helps."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = sorted({w for i in range(tok.get_vocab_size())
                    if (w := tok.decode([i]).strip()).isascii() and w.isalpha()})
    rng = random.Random(7)
    out = []
    for _ in range(args.rounds):
        row = []
        for _ in range(args.streams):
            text = rng.choice(words)
            while len(tok.encode(text).ids) < args.prompt:
                text += " " + rng.choice(words)
            row.append(text)
        out.append(row)
    return out


def _first_difference(a: str | list[int], b: str | list[int]) -> int | None:
    """Where ``a`` and ``b`` (texts, or token ids) first differ; None: nowhere."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def _greedy(runs: dict[str, list[dict[str, Any]]], one: str, tp: str
            ) -> tuple[list[str], list[str]]:
    """The greedy tokens compared: lines to print, and what differs that must not.

    Must be the same: each setup's runs (a run is deterministic), and every split setup's
    against ``tp``'s first run (the same ranks sum the same partial results in the same
    order, in one process or behind daemons: the ids in-process, the streamed text
    through a daemon). Against ``one`` process the split's logits are the same sums in
    another order, so a near-tie between two tokens (bfloat16 logits have 8 bits of
    mantissa) can go the other way: where each round parts is shown, not judged."""
    wrong: list[str] = []
    ref = runs[tp][0]
    for setup, reports in runs.items():
        for i, got in enumerate(reports):
            want = reports[0] if setup == one else ref
            for r, (texts, expected) in enumerate(zip(got["texts"], want["texts"],
                                                      strict=True)):
                for s, (text, other) in enumerate(zip(texts, expected, strict=True)):
                    ids = got.get("tokens")
                    at = (_first_difference(ids[r][s], want["tokens"][r][s])
                          if ids is not None and "tokens" in want else None)
                    at_text = _first_difference(text, other)
                    if at is not None or at_text is not None:
                        k = at_text or 0
                        wrong.append(f"{setup}, run {i + 1}, round {r + 1}, stream {s + 1}: "
                                     + (f"token {at + 1} differs; " if at is not None else "")
                                     + f"its text parts at character {k}: {text[k:k + 40]!r}"
                                     f", {'its first run' if setup == one else tp}'s "
                                     f"{other[k:k + 40]!r}")
    split = [k for k in runs if k != one]
    n = sum(len(runs[k]) for k in split)
    lines = [f"greedy tokens, {', '.join(split)}: "
             + ("the same in all" if not wrong else "NOT the same in all") + f" {n} runs "
             f"(ids in-process, the streamed text through a daemon); {one}: each run the "
             "same as its first" + (" (see below)" if wrong else "")]
    parts = []
    for r, (mine, theirs) in enumerate(zip(ref["tokens"], runs[one][0]["tokens"],
                                           strict=True)):
        for s, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            at = _first_difference(a, b)
            where = f"round {r + 1}" + (f" stream {s + 1}" if len(mine) > 1 else "")
            parts.append(f"{where}: " + ("the same" if at is None
                                          else f"parts at token {at + 1} of {len(a)}"))
    lines.append(f"greedy tokens, {tp} against {one} (the same sums in another order): "
                 + "; ".join(parts))
    return lines, wrong


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

    from tp_hosts import HOSTS, daemons_setup, ring_probe

    # Stopped by a signal, the setups' ``finally`` still end every process they started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from mlxceld.models import fixture_cache, preset
    model = fixture_cache(preset(args.preset))
    prompts = _prompts(model, args)
    print(f"model {args.preset} ({model}); prompt ~{args.prompt} tokens, {args.new} new "
          f"(greedy, ignore_eos), {args.streams} stream(s), {args.rounds} rounds per run, "
          f"{args.repeat} runs per setup, alternating", flush=True)
    one, tp = "one process", f"tp {args.tp}"
    daemon, hosts = f"tp {args.tp}, one daemon", f"tp {args.tp} across hosts"
    runs: dict[str, list[dict[str, Any]]] = {one: [], tp: [], daemon: [], hosts: []}
    memory: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeat):
        for setup in runs:
            if setup in (daemon, hosts):
                report = daemons_setup(model, args.tp, args, prompts, across=setup == hosts)
                memory[setup] = report["memory"]
            else:
                reports = _setup(model, 1 if setup == one else args.tp, args, prompts)
                report, memory[setup] = reports[0], reports
            runs[setup].append(report)
            print(f"  {setup}: TTFT {[round(t * 1000) for t, _ in report['rounds']]} ms, "
                  f"decode {[round(r, 1) for _, r in report['rounds']]} tok/s"
                  + ("; cores busy: " + ", ".join(f"{k} {c:.2f}" for k, c in
                                                  report["cores"].items())
                     if "cores" in report else ""), flush=True)
    ttft = {k: statistics.median(t for r in v for t, _ in r["rounds"]) for k, v in runs.items()}
    rate = {k: statistics.median(x for r in v for _, x in r["rounds"]) for k, v in runs.items()}
    _table(memory, ttft, rate, args)

    one_rss = memory[one][0]["rss"] - memory[one][0]["base"]
    above = ", ".join(f"{(r['rss'] - r['base']) / one_rss:.2f}" for r in memory[tp])
    less_ring = ", ".join(f"{(r['rss'] - r['base'] - r['ring']) / one_rss:.2f}"
                          for r in memory[tp])
    print(f"\nratios tp {args.tp} / one process: TTFT {ttft[tp] / ttft[one]:.2f}, decode "
          f"{rate[tp] / rate[one]:.2f}, RSS above the baseline per rank {above} (less its "
          f"ring's buffers {less_ring}), weights per rank "
          f"{memory[tp][0]['weights'] / memory[one][0]['weights']:.2f}")
    print(f"ratios tp {args.tp} across hosts / one process: TTFT {ttft[hosts] / ttft[one]:.2f}"
          f", decode {rate[hosts] / rate[one]:.2f}; / tp {args.tp} in one host: TTFT "
          f"{ttft[hosts] / ttft[tp]:.2f}, decode {rate[hosts] / rate[tp]:.2f}; / tp "
          f"{args.tp} behind one daemon: TTFT {ttft[hosts] / ttft[daemon]:.2f}, decode "
          f"{rate[hosts] / rate[daemon]:.2f}")

    # Where a decode step's time goes: each setup over the one before it, and the
    # ring's part measured alone (the same all_sums in a ring doing nothing else).
    config = json.loads((model / "config.json").read_text())
    shape = [args.streams, 1, config["hidden_size"]]
    per_step = 2 * config["num_hidden_layers"] + 1  # 2 per layer, and the sampled tokens
    probe = {"127.0.0.1": ring_probe(["127.0.0.1"] * args.tp, shape, 200),
             ", ".join(HOSTS[:args.tp]): ring_probe(HOSTS[:args.tp], shape, 200)}
    step = {k: 1000 * args.streams / rate[k] for k in runs}
    why = {tp: "the split: the ring, two ranks sharing the cores",
           daemon: "rank 0 behind a daemon: the OpenAI port, SSE, the detokenizer",
           hosts: "the ranks' daemons on two IPs (the ring across them)"}
    print(f"\nwhere a decode step's time goes (ms a step of {args.streams} token(s), from "
          "the median decode rate):")
    before = one
    print(f"  {one:<24} {step[one]:7.2f}")
    for k in (tp, daemon, hosts):
        print(f"  {k:<24} {step[k]:7.2f}  {step[k] - step[before]:+7.2f} over {before}: "
              f"{why[k]}")
        before = k
    for where, s_each in probe.items():
        print(f"  the ring on {where} alone: {s_each * 1e6:.0f} us an all_sum of {shape} "
              f"bf16; {per_step} a step: {per_step * s_each * 1000:.2f} ms")

    lines, wrong = _greedy(runs, one, tp)
    print("\n" + "\n".join(lines))
    if wrong:
        raise SystemExit("greedy tokens differ where they must not:\n  " + "\n  ".join(wrong))


def _table(memory: dict[str, list[dict[str, Any]]], ttft: dict[str, float],
           rate: dict[str, float], args: argparse.Namespace) -> None:
    mib = 1 << 20
    print("\n| setup | TTFT ms (median) | decode tok/s (median) | per process: RSS MiB "
          "(peak), above its baseline (anonymous, file-backed; joining the ring) "
          "| per process: mlx active / cache / peak MiB | weights MiB |")
    print("|---|---|---|---|---|---|")
    for setup, reports in memory.items():
        def who(r: dict[str, Any], setup: str = setup) -> str:
            return f"rank {r['rank']}" if setup != "one process" else "one process"

        if "base" not in reports[0]:  # across hosts: the workers read from outside
            procs = "; ".join(f"{who(r)} {r['rss'] / mib:.0f} ({r['peak'] / mib:.0f})"
                              for r in reports)
            print(f"| {setup} | {ttft[setup] * 1000:.0f} | {rate[setup]:.1f} | {procs} "
                  "| - | - |")
            continue
        procs = "; ".join(
            f"{who(r)} {r['rss'] / mib:.0f} ({r['peak'] / mib:.0f}), "
            f"+{(r['rss'] - r['base']) / mib:.0f} (anon "
            f"+{(r.get('rssanon', 0) - r['base_anon']) / mib:.0f}, file "
            f"+{(r.get('rssfile', 0) - r['base_file']) / mib:.0f}"
            + (f"; its ring +{r['ring'] / mib:.0f}" if "ring" in r else "") + ")"
            for r in reports)
        mlx = "; ".join(f"{who(r)} {r['active'] / mib:.0f} / {r['cache'] / mib:.0f} / "
                        f"{r['mlx_peak'] / mib:.0f}" for r in reports)
        print(f"| {setup} | {ttft[setup] * 1000:.0f} | {rate[setup]:.1f} | {procs} | {mlx} "
              f"| {reports[0]['weights'] / mib:.1f} |")


if __name__ == "__main__":
    main()
