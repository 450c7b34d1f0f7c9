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

``pipeline_rows`` is the hook for the 2-stage pipeline's rows (speculation over a
pipeline, built elsewhere): it returns none yet.

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


def pipeline_rows(pair: Pair, n: int, k: int) -> list[Runner]:
    """The 2-stage pipeline's rows (without a draft, then each draft; engine "ours, 2
    stages"): the hook for speculation over a pipeline, which another change builds."""
    return []


def report(pair: Pair, n: int, k: int, repeats: int = 3,
           more: Callable[[Pair, int, int], list[Runner]] = pipeline_rows) -> list[Row]:
    """Every row loaded, warmed up, then ``repeats`` rounds of one run each, in turn (a
    burst of load on a shared host slows one round of every row, not one row): each row's
    fastest run."""
    runners = [make(pair, draft, n, k) for make in (ours, mlx_lm)
               for draft in (None, "agreeing", "unrelated")] + more(pair, n, k)
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
