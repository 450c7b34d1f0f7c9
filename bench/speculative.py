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
(prefill left out), the fastest of ``--repeats`` runs (a shared host's load only slows a
run). Printed: tok/s, the ratio to the same engine without a draft, the acceptance rate
and the tokens per pass with proposals (ours from the engine's counters, over every run;
mlx-lm's from its ``from_draft`` flags), and ours over mlx-lm's. Ours backs off a draft
that does not pay (``engine/pacing.py``); mlx-lm's always proposes.

The 2-stage pipeline's rows (``pipeline_rows``): our daemons on loopback as
bench/pipeline.py runs them, the layers halved, the draft on the last stage
(``[cluster] draft_model``, ``pipeline/speculating.py``), the same k; decode tok/s of
one greedy stream through the OpenAI port (the client's SSE timestamps), the fastest of
``--repeats``.

    .venv/bin/python bench/speculative.py [--target small] [--tokens 256] [--k 4]
"""

from __future__ import annotations

import argparse
import asyncio
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


def ours(pair: Pair, draft: str | None, n: int, k: int, repeats: int) -> Row:
    from mlx_lm import load

    from mlxceld.engine import GenerationRequest, SamplingParams
    from mlxceld.engine.local import LocalEngine
    from mlxceld.engine.speculative import Draft

    model, tokenizer = load(str(pair.target))
    spec = None if draft is None else Draft(load(str(pair.drafts[draft]))[0], k)
    prompt = tokenizer.encode(PROMPT)

    async def run() -> tuple[int, float]:
        engine = LocalEngine(model, model_id="target", context_length=1 << 16,
                             eos_token_ids=set(), vocab_size=int(model.args.vocab_size),
                             max_batch=1, prompt_cache_bytes=0, draft=spec)
        try:
            runs = []
            for _ in range(1 + repeats):  # a warm-up, then the runs measured
                stamps: list[float] = []
                request = GenerationRequest("b", prompt, SamplingParams(max_tokens=n,
                                                                        temperature=0))
                async for _ in engine.generate(request):
                    stamps.append(time.perf_counter())
                runs.append((len(stamps), stamps[-1] - stamps[0]))
            return min(runs[1:], key=lambda r: r[1])
        finally:
            await engine.aclose()

    count, seconds = asyncio.run(run())
    stats = spec.snapshot() if spec is not None else None
    return Row("ours", draft, (count - 1) / seconds,
               None if stats is None else stats["acceptance_rate"],
               None if stats is None else stats["tokens_per_pass"])


def mlx_lm(pair: Pair, draft: str | None, n: int, k: int, repeats: int) -> Row:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step, speculative_generate_step

    model, tokenizer = load(str(pair.target))
    other = None if draft is None else load(str(pair.drafts[draft]))[0]
    prompt = mx.array(tokenizer.encode(PROMPT))
    flags: list[bool] = []

    def steps() -> Iterator[Any]:
        flags.clear()
        if other is None:
            yield from generate_step(prompt, model, max_tokens=n)
            return
        for token, logprobs, from_draft in speculative_generate_step(
                prompt, model, other, num_draft_tokens=k, max_tokens=n):
            flags.append(bool(from_draft))
            yield token, logprobs

    timed(steps())  # a warm-up
    count, seconds = min((timed(steps()) for _ in range(repeats)), key=lambda r: r[1])
    if other is None:
        return Row("mlx-lm", None, (count - 1) / seconds)
    accepted = sum(flags)
    # Each pass ends with one token of the target's own, but the last one when max_tokens
    # came among its accepted proposals.
    passes = count - accepted + (1 if flags and flags[-1] else 0)
    proposed = passes * k  # at most: a pass near max_tokens proposes fewer
    return Row("mlx-lm", draft, (count - 1) / seconds, accepted / proposed, count / passes)


def pipeline_rows(pair: Pair, n: int, k: int, repeats: int) -> list[Row]:
    """The 2-stage pipeline's rows ("ours, 2 stages"): our daemons on loopback as
    bench/pipeline.py runs them (a coordinator on 127.0.0.1, stages on .2 and .3, the
    layers halved), without a draft and with each ([cluster] draft_model, k): decode tok/s
    of one greedy stream through the OpenAI port, the fastest of ``repeats`` after the
    warm-up; the acceptance and tokens per pass from the last stage's counters."""
    import tempfile

    from loopback import Cluster, start_cluster, stop_all, stream_once

    from mlxceld.models.identity import layer_count, read_model_config

    layers = layer_count(read_model_config(pair.target), source=str(pair.target))
    splits = [(0, layers // 2), (layers // 2, layers)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxceld-spec-") as tmp:
        for draft in (None, "agreeing", "unrelated"):
            clusters: list[Cluster] = []
            try:
                cluster = start_cluster(
                    Path(tmp) / (draft or "none"), pair.target, splits,
                    ["127.0.0.2", "127.0.0.3"], clusters,
                    None if draft is None else (pair.drafts[draft], k))
                runs = []
                for _ in range(repeats):  # each with the stages' counters around it
                    before = stage_stats(cluster)
                    run = stream_once(cluster, PROMPT, n)
                    runs.append((run, before, stage_stats(cluster)))
                best, before, after = max(runs, key=lambda r: r[0].decode_tps)
                stats = after[-1].get("speculative") if draft else None
                rows.append(Row("ours, 2 stages", draft, best.decode_tps,
                                None if stats is None else stats["acceptance_rate"],
                                None if stats is None else stats["tokens_per_pass"]))
                where_time_goes(draft, best, before, after)
            finally:
                stop_all(clusters)
    return rows


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
    steps = [1000 * delta(r, "compute_s") / max(1.0, delta(r, "steps"))
             for r in range(len(after))]
    total = 1000 * run.total_s / max(1.0, passes)
    print(f"2 stages, draft {draft or 'none'}: {run.tokens} tokens in {passes:.0f} "
          f"passes, {total:.1f} ms a pass (prefill included): "
          + ", ".join(f"stage {i} {ms:.1f}" for i, ms in enumerate(steps))
          + f" (of which drafting {drafting:.1f}), the rest {total - sum(steps):.1f} "
          "(hops, router, client, CPU waits)")


def report(pair: Pair, n: int, k: int, repeats: int = 3,
           more: Callable[[Pair, int, int, int], list[Row]] = pipeline_rows) -> list[Row]:
    rows = [measure(pair, draft, n, k, repeats) for measure in (ours, mlx_lm)
            for draft in (None, "agreeing", "unrelated")] + more(pair, n, k, repeats)
    print(f"target {pair.target.name}: {n} greedy tokens from one prompt, k = {k}, "
          f"one sequence; the fastest of {repeats} runs after a warm-up")
    print(f"{'engine':<16}{'draft':<11}{'tok/s':>9}{'vs none':>9}{'accepted':>10}"
          f"{'tok/pass':>10}")
    base = {r.engine: r.tok_s for r in rows if r.draft is None}
    for r in rows:
        print(f"{r.engine:<16}{r.draft or 'none':<11}{r.tok_s:>9.1f}"
              f"{r.tok_s / base[r.engine]:>8.2f}x"
              + (f"{r.acceptance:>10.2f}{r.per_pass:>10.2f}"
                 if r.acceptance is not None and r.per_pass is not None else ""))
    theirs = {r.draft: r.tok_s for r in rows if r.engine == "mlx-lm"}
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
    args = parser.parse_args()
    report(fixtures(args.target), args.tokens, args.k, args.repeats)


if __name__ == "__main__":
    main()
