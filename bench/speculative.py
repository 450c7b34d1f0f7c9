"""Single-stream decode with a draft model (speculative decoding) against none, on one host,
beside mlx-lm's own speculative decoding with the same pairs.

The target: ``--target`` (a ``FixtureSpec`` preset: ``small``, llama: 8 layers, hidden 512,
bfloat16), its layers' output projections zeroed (``fixtures/pairs.py``), so that its
compute is a real model's while its tokens depend on the last token alone. Two drafts,
one layer each, with its tokenizer: the agreeing one (its embedding, norm and head: every
proposal right, acceptance 1.0) and an unrelated random one (acceptance near 0). For each,
``--tokens`` greedy tokens from one prompt, after a warm-up run:

- ours: the local engine (``LocalEngine``, one sequence: it speculates; no end-of-sequence
  token, so every run is as long), without a draft and with each, k = ``--k``;
- mlx-lm's: ``generate_step`` without a draft and ``speculative_generate_step`` with each
  (mlx-lm's ``generate --draft-model``), the same k.

Decode tok/s is the tokens after the first over the time from the first to the last
(prefill left out), the fastest of ``--repeats`` runs, the rows taking turns (a shared
host's load only slows a run). Printed: tok/s, the ratio to the same engine without a
draft, the acceptance rate and the tokens per pass with proposals (ours from the engine's
counters, mlx-lm's from its ``from_draft`` flags; over every run), and ours over
mlx-lm's. Ours backs off a draft that does not pay (``engine/pacing.py``); mlx-lm's
always proposes.

The 2-stage pipeline's rows (``pipeline_rows``): our daemons on loopback as
bench/pipeline.py runs them, the layers halved, the draft on the last stage
(``[cluster] draft_model``, ``pipeline/speculating.py``), the same k; decode tok/s of
one greedy stream through the OpenAI port (the client's SSE timestamps), the fastest of
``--repeats``.

``--pin``: each stage's worker on a CPU of its own (``pinned``), as on hosts of their
own, where the last stage drafts the next pass while a pass is away at the first stage
(``pipeline/speculating.py``'s drafting ahead) without taking the first stage's CPU;
``--pipeline-only``: the 2-stage rows alone.

    .venv/bin/python bench/speculative.py [--target small] [--tokens 256] [--k 4]
        [--pin] [--pipeline-only]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT = "The quick brown fox jumps over the lazy dog"


@dataclass(frozen=True)
class Pair:
    target: Path
    drafts: dict[str, Path]  # by name: "agreeing", "unrelated"


@dataclass(frozen=True)
class Row:
    engine: str  # "ours", "mlx-lm", "ours, 2 stages", ...
    draft: str | None
    tok_s: float
    acceptance: float | None = None
    per_pass: float | None = None


def fixtures(name: str) -> Pair:
    """The zeroed target of preset ``name`` (llama) and its two drafts, cached."""
    from mlxceld.models.fixtures import agreeing_pair, fixture_cache, preset, unrelated_draft

    target, agreeing = agreeing_pair(preset(name, family="llama"))
    return Pair(fixture_cache(target), {"agreeing": fixture_cache(agreeing),
                                        "unrelated": fixture_cache(unrelated_draft(target))})


def timed(tokens: Iterator[Any]) -> tuple[int, float]:
    """How many ``tokens`` came, and the seconds from the first to the last."""
    n, first, last = 0, 0.0, 0.0
    for _ in tokens:
        last = time.perf_counter()
        if n == 0:
            first = last
        n += 1
    return n, last - first


@dataclass
class Runner:
    """One row's setup, loaded once: ``run`` decodes one sequence (its tokens and the
    seconds from the first to the last), ``counters`` reads (acceptance, tokens per pass)
    once the runs are done (None without a draft), ``close`` ends it."""

    engine: str
    draft: str | None
    run: Callable[[], tuple[int, float]]
    counters: Callable[[], tuple[float, float] | None]
    close: Callable[[], None] = lambda: None


def ours(pair: Pair, draft: str | None, n: int, k: int) -> Runner:
    from mlx_lm import load

    from mlxceld.engine import GenerationRequest, SamplingParams
    from mlxceld.engine.local import LocalEngine
    from mlxceld.engine.speculative import Draft

    model, tokenizer = load(str(pair.target))
    spec = None if draft is None else Draft(load(str(pair.drafts[draft]))[0], k)
    prompt = tokenizer.encode(PROMPT)
    engine = LocalEngine(model, model_id="target", context_length=1 << 16,
                         eos_token_ids=set(), vocab_size=int(model.args.vocab_size),
                         max_batch=1, prompt_cache_bytes=0, draft=spec)

    async def decode() -> tuple[int, float]:
        stamps: list[float] = []
        request = GenerationRequest("b", prompt, SamplingParams(max_tokens=n, temperature=0))
        async for _ in engine.generate(request):
            stamps.append(time.perf_counter())
        return len(stamps), stamps[-1] - stamps[0]

    def counters() -> tuple[float, float] | None:
        stats = None if spec is None else spec.snapshot()
        return None if stats is None else (stats["acceptance_rate"], stats["tokens_per_pass"])

    return Runner("ours", draft, lambda: asyncio.run(decode()), counters,
                  lambda: asyncio.run(engine.aclose()))


def mlx_lm(pair: Pair, draft: str | None, n: int, k: int) -> Runner:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step, speculative_generate_step

    model, tokenizer = load(str(pair.target))
    other = None if draft is None else load(str(pair.drafts[draft]))[0]
    prompt = mx.array(tokenizer.encode(PROMPT))
    flags: list[bool] = []

    def steps() -> Iterator[Any]:
        if other is None:
            yield from generate_step(prompt, model, max_tokens=n)
            return
        for token, logprobs, from_draft in speculative_generate_step(
                prompt, model, other, num_draft_tokens=k, max_tokens=n):
            flags.append(bool(from_draft))
            yield token, logprobs

    def counters() -> tuple[float, float] | None:
        if other is None:
            return None
        accepted = sum(flags)
        # Each pass ends with one token of the target's own, but a run's last pass when
        # max_tokens came among its accepted proposals.
        runs = len(flags) // n
        passes = len(flags) - accepted + sum(flags[i * n + n - 1] for i in range(runs))
        proposed = passes * k  # at most: a pass near max_tokens proposes fewer
        return accepted / proposed, len(flags) / passes

    return Runner("mlx-lm", draft, lambda: timed(steps()), counters)


def pinned(workers: list[Any]) -> None:
    """Each stage worker's threads on a CPU of their own, stage i on CPU i (of those this
    process may use): two hosts, as far as one machine can show them, each stage's
    compute never waiting for another's. The router's and the client's are left free."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    for i, proc in enumerate(workers):
        for thread in proc.threads():
            os.sched_setaffinity(thread.id, {cpus[i % len(cpus)]})


def pipeline_rows(pair: Pair, n: int, k: int, pin: bool = False) -> list[Runner]:
    """The 2-stage pipeline's rows ("ours, 2 stages"): our daemons on loopback as
    bench/pipeline.py runs them (a coordinator on 127.0.0.1, stages on .2 and .3, the
    layers halved), without a draft and with each ([cluster] draft_model, k), all started
    first; a run is one greedy stream through the OpenAI port (its decode span from the
    client's SSE timestamps); the acceptance and tokens per pass from the last stage's
    counters; where the fastest run's time went is printed as the rows close. ``pin``:
    each stage's worker on a CPU of its own (``pinned``)."""
    import shutil
    import tempfile

    from loopback import Cluster, start_cluster, stop_all

    from mlxceld.models.identity import layer_count, read_model_config

    layers = layer_count(read_model_config(pair.target), source=str(pair.target))
    splits = [(0, layers // 2), (layers // 2, layers)]
    tmp = Path(tempfile.mkdtemp(prefix="mlxceld-spec-"))
    clusters: list[Cluster] = []
    runners = []
    try:
        for draft in (None, "agreeing", "unrelated"):
            cluster = start_cluster(tmp / (draft or "none"), pair.target, splits,
                                    [f"127.0.0.{2 + 2 * len(runners)}",
                                     f"127.0.0.{3 + 2 * len(runners)}"], clusters,
                                    None if draft is None else (pair.drafts[draft], k))
            if pin:
                pinned(cluster.workers[:len(splits)])
            runners.append(_pipeline_runner(cluster, draft, n, pin))
    except BaseException:
        stop_all(clusters)
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    def close() -> None:
        stop_all(clusters)
        shutil.rmtree(tmp, ignore_errors=True)

    runners[-1].close = close
    return runners


def _pipeline_runner(cluster: Any, draft: str | None, n: int, pin: bool) -> Runner:
    from loopback import stream_once

    fastest: list[Any] = []  # (stream, stage stats before, after), after the warm-up
    runs = [0]

    def run() -> tuple[int, float]:
        before = stage_stats(cluster)
        stream = stream_once(cluster, PROMPT, n)
        runs[0] += 1
        if runs[0] > 1 and (not fastest or stream.decode_tps > fastest[0].decode_tps):
            fastest[:] = [stream, before, stage_stats(cluster)]
        return stream.tokens, stream.decode_s

    def counters() -> tuple[float, float] | None:
        stream, before, after = fastest
        where_time_goes(draft, stream, before, after)
        stats = after[-1].get("speculative") if draft else None
        return None if stats is None else (stats["acceptance_rate"], stats["tokens_per_pass"])

    return Runner("ours, 2 pinned" if pin else "ours, 2 stages", draft, run, counters)


def stage_stats(cluster: Any) -> list[dict[str, Any]]:
    """Each stage worker's stats (refreshed every second), after a second."""
    from mlxceld.supervisor import channel
    from mlxceld.supervisor.ops import Stats

    time.sleep(1.2)

    async def read() -> list[dict[str, Any]]:
        return [(await channel.call(cluster.root / f"stage-{rank}" / "workers" / "stage.sock",
                                    Stats()))["stats"] for rank in range(len(cluster.stages))]

    return asyncio.run(read())


def where_time_goes(draft: str | None, run: Any, before: list[dict[str, Any]],
                    after: list[dict[str, Any]]) -> None:
    """The fastest run's time a pass, in ms (its stages' counters before and after it):
    each stage's compute a step, the last stage's drafting, and the rest (hops, the
    router, the client, waiting for a CPU)."""
    def delta(rank: int, *keys: str) -> float:
        a, b = after[rank], before[rank]
        for key in keys[:-1]:
            a, b = a.get(key) or {}, b.get(key) or {}
        return float(a.get(keys[-1], 0)) - float(b.get(keys[-1], 0))

    last = len(after) - 1
    passes = delta(last, "steps")  # each pass runs one step a stage (and the prefill)
    drafting = 1000 * delta(last, "speculative", "draft_s") / max(1.0, passes)
    ahead = delta(last, "speculative", "drafted_ahead")
    steps = [1000 * delta(r, "compute_s") / max(1.0, delta(r, "steps"))
             for r in range(len(after))]
    total = 1000 * run.total_s / max(1.0, passes)
    print(f"2 stages, draft {draft or 'none'}: {run.tokens} tokens in {passes:.0f} "
          f"passes, {total:.1f} ms a pass (prefill included): "
          + ", ".join(f"stage {i} {ms:.1f}" for i, ms in enumerate(steps))
          + f" (of which waiting for the draft {drafting:.1f}; {ahead:.0f} passes drafted "
          f"ahead), the rest {total - sum(steps):.1f} (hops, router, client, CPU waits)")


def report(pair: Pair, n: int, k: int, repeats: int = 3,
           more: Callable[[Pair, int, int], list[Runner]] = pipeline_rows,
           one_host: bool = True) -> list[Row]:
    """Every row loaded, warmed up, then ``repeats`` rounds of one run each, in turn (a
    burst of load on a shared host slows one round of every row, not one row): each row's
    fastest run. ``one_host``: with ours and mlx-lm's rows on one host (else ``more``'s
    alone)."""
    runners = [make(pair, draft, n, k) for make in (ours, mlx_lm)
               for draft in (None, "agreeing", "unrelated") if one_host] + more(pair, n, k)
    best: dict[int, float] = {}
    try:
        for round_ in range(1 + repeats):
            for i, runner in enumerate(runners):
                count, seconds = runner.run()
                if round_:  # the first is the warm-up
                    best[i] = max(best.get(i, 0.0), (count - 1) / seconds)
    finally:
        for runner in runners:
            runner.close()
    rows = []
    for i, runner in enumerate(runners):
        counted = runner.counters()
        rows.append(Row(runner.engine, runner.draft, best[i], *(counted or (None, None))))
    print(f"target {pair.target.name}: {n} greedy tokens from one prompt, k = {k}, "
          f"one sequence; each row's fastest of {repeats} runs, after a warm-up")
    print(f"{'engine':<16}{'draft':<11}{'tok/s':>9}{'vs none':>9}{'accepted':>10}"
          f"{'tok/pass':>10}")
    base = {r.engine: r.tok_s for r in rows if r.draft is None}
    for r in rows:
        print(f"{r.engine:<16}{r.draft or 'none':<11}{r.tok_s:>9.1f}"
              f"{r.tok_s / base[r.engine]:>8.2f}x"
              + (f"{r.acceptance:>10.2f}{r.per_pass:>10.2f}"
                 if r.acceptance is not None and r.per_pass is not None else ""))
    theirs = {r.draft: r.tok_s for r in rows if r.engine == "mlx-lm"}
    if theirs:
        print("ours / mlx-lm: " + ", ".join(
            f"{r.draft or 'none'} {r.tok_s / theirs[r.draft]:.2f}x" for r in rows
            if r.engine == "ours"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="small", help="the target's fixture preset")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs measured per row "
                        "(the fastest is kept: a shared host's load only slows runs)")
    parser.add_argument("--pin", action="store_true", help="each stage's worker on a CPU "
                        "of its own, as on hosts of their own (the 2-stage rows)")
    parser.add_argument("--pipeline-only", action="store_true",
                        help="the 2-stage rows alone (no one-host or mlx-lm rows)")
    args = parser.parse_args()
    report(fixtures(args.target), args.tokens, args.k, args.repeats,
           functools.partial(pipeline_rows, pin=args.pin), one_host=not args.pipeline_only)


if __name__ == "__main__":
    main()
