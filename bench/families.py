"""Every family we split: our 2-stage pipeline against mlx-lm, alone and pipelined, one run.

For each family (``--families``, default all of ``families.SUPPORTED``) it writes
a random-weight fixture with our generator (cached per machine, as bench/pipeline.py
does): 8 layers, hidden 512, 8 heads (4 for keys and values), vocabulary 4096;
dense families in bfloat16 with an MLP 1408 wide, MoE families in float32 (mlx's
CPU ``gather_mm`` runs unquantized experts in float32 only) with 4 experts 704 wide,
2 per token (so a token's active MLP is as wide as the dense ones'); gemma3 and
gpt_oss with a sliding window of 32 tokens, which the generation passes; mistral is
the llama fixture with its config's ``model_type`` changed, as mlx-lm loads it with
llama's classes. Weights are in shards of 16 MiB with an index (mlx-lm's
``sharded_load`` needs one). Then, for the same prompt and the same number of
greedy tokens:

- mlx-lm single: ``stream_generate`` in this process;
- ours: a 2-stage pipeline of real daemons on loopback (a coordinator on
  127.0.0.1 serving the OpenAI API, stages [0, 4) and [4, 8) on 127.0.0.2 and .3,
  AES-256-GCM), as bench/pipeline.py starts it (bench/loopback.py), one streamed
  /v1/completions request at a time;
- mlx-lm pipeline: two ranks by ``mlx.launch --backend ring`` on 127.0.0.1 running
  ``sharded_load`` with the ring group (bench/mlxlm.py), where mlx-lm can pipeline the
  family (its model class has ``pipeline``: detected, not listed); "n/a" otherwise.

Decode tok/s is tokens after the first over the time from the first to the last
(the first token's time is the prefill's): of the yielded tokens for mlx-lm; for ours,
the end of a streamed /v1/completions request for all the tokens less the end of one
for 1 token (the router streams text, and holds back tokens that are not whole text
yet, as a random model's often are), so ours includes the router's HTTP, SSE and
detokenizing, and the client's parsing, on the same CPUs. Each is the median of ``--runs`` runs
after a warm-up; mlx-lm single and ours alternate run by run, mlx-lm's pipeline runs
after our cluster is stopped, so that it has the CPUs to itself as the others have.

The prompt is the first of ``PROMPTS`` after which mlx-lm single generates all
``--max-tokens`` tokens without an EOS (all three stop at EOS). Tokens are checked:
mlx-lm's pipeline's ids against mlx-lm single's, ours (text over HTTP: the API has
no token ids) against mlx-lm single's streamed text, token by token; "differ" is the
number of tokens from the first that differs to the end, 0 when all match.

Memory: each of our stage workers' RSS after the runs (steady), its peak (VmHWM,
Linux) and its RSS once it runs, before any request (loaded), against the stage's
share of the weights (its parameter bytes, from the safetensors headers:
``layer_profile``), raw and net of two bare processes' RSS, measured once per run:
an empty mlx process (python and mlx imported, one op evaluated: the fixed cost of
any mlx process), and one that has also imported our stage worker's modules (mlx-lm
and transformers among them: a stage's fixed cost before its weights). Goal: RSS
at most 1.1 x the share. mlx-lm's ranks are shown beside them (each holds the
embeddings, the final norm and the head too).

On a machine with few CPUs the stages, the router, the client and mlx-lm's ranks
share them: the ratios are what this machine gives, and where two numbers differ
by less than the spread of their runs (printed) they are within noise.

``--quick``: the ``tiny`` shapes (2 layers, hidden 64, float32), 8 tokens, 1 run,
qwen2 and gemma3_text (one family mlx-lm pipelines, one it does not); what
tests/bench/test_families_bench.py runs.

    .venv/bin/python bench/families.py [--quick] [--families qwen2,gpt_oss]
        [--max-tokens 64] [--runs 3] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loopback import Cluster, in_scratch, start_cluster, stop_all, stream_once
from mlxlm import (
    PipelineFailed,
    Rank,
    Run,
    end_tree,
    greedy,
    peak_rss,
    pipeline_problem,
    run_pipeline,
)
from streams import Stream

MIB = 1 << 20
GOAL_RSS = 1.1
PROMPTS = ("The quick brown fox", "Once upon a time in a small village by the sea",
           "Hello, world", "A list of colours: red, green,", "In 1905 Einstein")
QUICK_FAMILIES = ("qwen2", "gemma3_text")
# An empty mlx process (what any mlx process holds before its model), and one that has
# also imported what our stage worker imports before it loads (mlx-lm, and transformers
# with it: the fixed cost of a stage, and of an mlx-lm rank, beyond mlx's).
BARE = ("import mlx.core as mx, psutil; mx.eval(mx.ones(8) + 1); "
        "print(psutil.Process().memory_info().rss)")
BARE_STAGE = "import mlxceld.workers.stage, mlxceld.models.slicing; " + BARE


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    max_tokens: int = 64
    runs: int = 3
    timeout_s: float = 600.0  # each subprocess's and each request's limit
    fixtures: Path | None = None  # the fixture cache's root; None: the per-machine one


# -- the fixtures ----------------------------------------------------------------------------


def fixture_spec(family: str, quick: bool) -> Any:
    """The benchmark's fixture of ``family`` (mistral: llama's, see ``fixture``)."""
    from mlxceld.models import preset
    from mlxceld.models.fixtures.families import TRAITS

    generated = "llama" if family == "mistral" else family
    changes: dict[str, Any] = {}
    if TRAITS[generated].moe:
        changes.update(dtype="float32", experts=4, experts_per_token=2)
        if not quick:
            changes["intermediate"] = 704
    if TRAITS[generated].window:
        changes["sliding_window"] = 4 if quick else 32
    if quick:
        return preset("tiny", family=generated, shard_bytes=64 << 10, **changes)
    return preset("small", family=generated, shard_bytes=16 * MIB, **changes)


def fixture(family: str, settings: Settings, root: Path) -> Path:
    from mlxceld.models import fixture_cache

    path: Path = fixture_cache(fixture_spec(family, settings.quick), settings.fixtures)
    if family != "mistral":
        return path
    target = root / "mistral-model"  # the llama fixture, read by mlx-lm as mistral
    shutil.copytree(path, target)
    config = target / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "mistral"}))
    return target


def shapes(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    experts = (text.get("num_experts") or text.get("num_local_experts")
               or text.get("n_routed_experts"))
    width = text.get("moe_intermediate_size") or text["intermediate_size"]
    moe = f", {experts} experts {width} wide, {text['num_experts_per_tok']} per token" \
        if experts else f", MLP {width} wide"
    window = f", window {text['sliding_window']}" if text.get("sliding_window") else ""
    return (f"{text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
            f"{text['num_attention_heads']}/{text['num_key_value_heads']} heads{moe}{window}, "
            f"vocab {config.get('vocab_size', text.get('vocab_size'))}, "
            f"{config.get('torch_dtype', text.get('torch_dtype'))}")


def bare_rss(timeout_s: float, code: str = BARE) -> int:
    """RSS of an empty mlx process: python and mlx imported, one op evaluated
    (``BARE_STAGE``: our stage worker's modules imported too)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=timeout_s).stdout
    return int(out.split()[-1])


# -- one family ------------------------------------------------------------------------------


@dataclass
class Memory:
    """A stage's (or a rank's) resident memory against the parameter bytes it holds."""

    who: str
    layers: tuple[int, int]
    share: int
    rss: int
    peak: int | None
    loaded: int | None = None  # RSS once it ran, before any request (ours only)


@dataclass
class FamilyResult:
    family: str
    shapes: str
    prompt: str
    prompt_tokens: int
    single: list[Stream] = field(default_factory=list)
    ours: list[Stream] = field(default_factory=list)
    pipeline: list[Stream] = field(default_factory=list)
    no_pipeline: str | None = None  # why mlx-lm's pipeline was not run
    ours_differ: int = 0
    pipeline_differ: int = 0
    memory: list[Memory] = field(default_factory=list)
    weights: int = 0
    failures: dict[str, str] = field(default_factory=dict)  # "ours", "pipeline": why

    def tps(self, runs: list[Stream]) -> float:
        return statistics.median(s.decode_tps for s in runs)


def choose_prompt(model: Any, tokenizer: Any, max_tokens: int) -> tuple[str, Run]:
    """The first of ``PROMPTS`` after which mlx-lm generates ``max_tokens`` tokens without
    an EOS (else the one it goes furthest with), and that generation."""
    best: tuple[str, Run] | None = None
    for prompt in PROMPTS:
        run = greedy(model, tokenizer, tokenizer.encode(prompt), max_tokens)
        if best is None or len(run.ids) > len(best[1].ids):
            best = (prompt, run)
        if len(run.ids) == max_tokens:
            break
    assert best is not None
    return best


def differing_text(reference: Run, text: str) -> int:
    """Tokens of ``reference`` from the first whose streamed text ``text`` does not carry
    on with, to the end (0: the same text)."""
    if text == reference.text:
        return 0
    done = ""
    for i, piece in enumerate(reference.pieces[:len(reference.ids)]):
        done += piece
        if not text.startswith(done):
            return len(reference.ids) - i
    return 1  # the reference's text is a prefix of ours: ours went on


def differing_ids(reference: list[int], ids: list[int]) -> int:
    for i, (a, b) in enumerate(zip(reference, ids, strict=False)):
        if a != b:
            return max(len(reference), len(ids)) - i
    return abs(len(reference) - len(ids))


def ours_run(cluster: Cluster, prompt: str, max_tokens: int) -> Stream:
    """One timed generation through our pipeline. Its decode time is that of a request for
    ``max_tokens`` tokens less that of one for 1 (each to the end of its stream): the
    router streams text, and holds back a token that is not yet whole text (a random
    model emits many), so the chunks' own times would say when text came, not tokens."""
    one = stream_once(cluster, prompt, 1)
    full = stream_once(cluster, prompt, max_tokens)
    return Stream(one.total_s, full.tokens, max(full.total_s - one.total_s, 1e-9),
                  full.total_s, full.text)


def measure_ours(res: FamilyResult, path: Path, single: tuple[Any, Any], reference: Run,
                 settings: Settings, root: Path, clusters: list[Cluster]) -> None:
    """Our 2-stage pipeline, alternating run by run with mlx-lm single; then the stages'
    memory."""
    from mlxceld.models import layer_profile, read_model_config

    text = read_model_config(path).get("text_config") or read_model_config(path)
    layers = int(text["num_hidden_layers"])
    splits = [(0, layers // 2), (layers // 2, layers)]
    started = time.monotonic()
    cluster = start_cluster(root / "ours", path, splits, ["127.0.0.2", "127.0.0.3"], clusters)
    cluster.http.timeout = settings.timeout_s
    say(res.family, f"our cluster up in {time.monotonic() - started:.1f} s")
    stream_once(cluster, res.prompt, 4)  # warm up
    ids = reference.ids
    for _ in range(settings.runs):
        run = greedy(*single, single[1].encode(res.prompt), settings.max_tokens)
        res.single.append(run.stream)
        res.ours.append(s := ours_run(cluster, res.prompt, settings.max_tokens))
        res.ours_differ = max(res.ours_differ, differing_text(reference, s.text),
                              abs(s.tokens - len(ids)))
    profile = layer_profile(path)
    for rank, ((start, end), worker, loaded) in enumerate(
            zip(splits, cluster.workers, cluster.ready_rss, strict=False)):
        res.memory.append(Memory(f"ours {rank}", (start, end), profile.weight_bytes(start, end),
                                 worker.memory_info().rss, peak_rss(worker.pid), loaded))
    res.weights = profile.total_bytes


def measure_family(family: str, settings: Settings, root: Path, clusters: list[Cluster],
                   procs: list[subprocess.Popen[bytes]]) -> FamilyResult:
    import mlx.core as mx
    import mlx_lm

    root.mkdir(parents=True)
    started = time.monotonic()
    path = fixture(family, settings, root)
    model, tokenizer = mlx_lm.load(str(path))[:2]
    try:
        prompt, reference = choose_prompt(model, tokenizer, settings.max_tokens)
        res = FamilyResult(family, shapes(path), prompt, len(tokenizer.encode(prompt)))
        say(family, f"{shapes(path)}; prompt {prompt!r} (fixture, load and prompt in "
                    f"{time.monotonic() - started:.1f} s)")
        try:
            measure_ours(res, path, (model, tokenizer), reference, settings, root, clusters)
        except (Exception, SystemExit) as exc:  # a finding: the other families still run
            res.failures["ours"] = failed(family, "our pipeline", exc)
        finally:
            stop_all(clusters)
    finally:
        del model
        mx.clear_cache()
    res.no_pipeline = pipeline_problem(path)
    if res.no_pipeline is None:
        started = time.monotonic()
        try:
            ranks = run_pipeline(path, tokenizer.encode(prompt), settings.max_tokens,
                                 settings.runs, root / "mlx-lm", settings.timeout_s, procs)
        except PipelineFailed as exc:
            res.failures["pipeline"] = failed(family, "mlx-lm's pipeline", exc)
            return res
        say(family, f"mlx-lm's pipeline: launched, loaded and run in "
                    f"{time.monotonic() - started:.1f} s")
        res.pipeline = [r.stream for r in ranks[0].runs]
        res.pipeline_differ = max(differing_ids(reference.ids, r.ids) for r in ranks[0].runs)
        res.memory += [rank_memory(r) for r in sorted(ranks, key=lambda r: r.layers)]
    return res


def say(family: str, what: str) -> None:
    print(f"[{family}] {what}", flush=True)


def failed(family: str, what: str, exc: BaseException) -> str:
    """Say in full why ``what`` failed on ``family``; its first line, for the table."""
    text = str(exc) or type(exc).__name__
    say(family, f"{what} failed: {text}")
    return text.splitlines()[0]


def rank_memory(rank: Rank) -> Memory:
    return Memory(f"mlx-lm rank {rank.rank}", rank.layers, rank.weights, rank.rss,
                  rank.peak_rss)


def run(families: list[str], settings: Settings, root: Path) -> list[FamilyResult]:
    """Measure each family in turn; every daemon and rank started is ended by pid before
    this returns or raises (an interrupt too)."""
    clusters: list[Cluster] = []
    procs: list[subprocess.Popen[bytes]] = []
    results = []
    try:
        for family in families:
            results.append(measure_family(family, settings, root / family, clusters, procs))
    finally:
        stop_all(clusters)
        for p in list(procs):
            end_tree(p)
    return results


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bare:
    """The RSS of the two bare processes (``BARE``, ``BARE_STAGE``)."""

    mlx: int
    stage: int

    @classmethod
    def measure(cls, timeout_s: float) -> Bare:
        return cls(bare_rss(timeout_s), bare_rss(timeout_s, BARE_STAGE))


def spread(runs: list[Stream]) -> str:
    values = [s.decode_tps for s in runs]
    return f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""


def report(results: list[FamilyResult], settings: Settings, bare: Bare) -> str:
    lines = [f"{settings.max_tokens} tokens greedy, median of {settings.runs} run(s) after a "
             f"warm-up (slowest-fastest in brackets); decode tok/s excludes the first token; "
             f"load average now {' '.join(f'{x:.1f}' for x in os.getloadavg())}"]
    for r in results:
        lines += family_table(r, bare)
    lines += summary(results, bare)
    return "\n".join(lines)


def cell(r: FamilyResult, target: str, runs: list[Stream]) -> str:
    """A target's median decode tok/s and spread, or why there is none."""
    if runs:
        return f"{r.tps(runs):8.1f}{spread(runs)}"
    if target == "pipeline" and r.no_pipeline is not None:
        return f"     n/a ({r.no_pipeline})"
    return f"  failed ({r.failures.get(target, 'no run')})"


def ratio(r: FamilyResult, over: list[Stream]) -> float | None:
    return r.tps(r.ours) / r.tps(over) if r.ours and over else None


def family_table(r: FamilyResult, bare: Bare) -> list[str]:
    to_single, to_pipeline = ratio(r, r.single), ratio(r, r.pipeline)
    lines = ["", f"{r.family}: {r.shapes}; {r.weights / MIB:.1f} MiB of weights; prompt "
             f"{r.prompt!r} ({r.prompt_tokens} tokens)",
             f"  decode tok/s  mlx-lm single   {cell(r, 'single', r.single)}",
             f"                ours 2-stage    {cell(r, 'ours', r.ours)}",
             f"                mlx-lm pipeline {cell(r, 'pipeline', r.pipeline)}"]
    if to_single is not None:
        lines.append(f"  ours / single {to_single:.2f}" + (
            f"   ours / mlx-lm pipeline {to_pipeline:.2f}" if to_pipeline is not None else ""))
    differ = ([f"ours {r.ours_differ}"] if r.ours else []) + (
        [f"mlx-lm pipeline {r.pipeline_differ}"] if r.pipeline else [])
    lines += [f"  tokens differing from mlx-lm single: {', '.join(differ) or '-'}",
              f"  memory (RSS: steady, after the runs){'layers':>21}{'share':>8}{'loaded':>8}"
              f"{'RSS':>7}{'peak':>7}{'RSS/share':>10}{'-mlx':>7}{'-imports':>9}"
              f"{'loaded-imp':>11}"]
    for m in r.memory:
        peak = "-" if m.peak is None else f"{m.peak / MIB:.0f}M"
        loaded = "-" if m.loaded is None else f"{m.loaded / MIB:.0f}M"
        loaded_net = "-" if m.loaded is None else f"{(m.loaded - bare.stage) / m.share:.2f}"
        lines.append(f"    {m.who:<45}{f'[{m.layers[0]},{m.layers[1]})':>9}"
                     f"{m.share / MIB:>7.1f}M{loaded:>8}{m.rss / MIB:>6.0f}M{peak:>7}"
                     f"{m.rss / m.share:>10.2f}{(m.rss - bare.mlx) / m.share:>7.2f}"
                     f"{(m.rss - bare.stage) / m.share:>9.2f}{loaded_net:>11}")
    return lines


def summary(results: list[FamilyResult], bare: Bare) -> list[str]:
    lines = ["", f"share: the parameter bytes a stage holds; loaded: its RSS once it runs, "
             f"before any request; peak: VmHWM; -mlx: (RSS - {bare.mlx / MIB:.0f} MiB, an "
             f"empty mlx process) / share; -imports: (RSS - {bare.stage / MIB:.0f} MiB, a "
             f"process that has imported our stage worker's modules, mlx-lm among them) / "
             f"share; loaded-imp: the same of loaded; goal: RSS <= {GOAL_RSS} x share",
             "",
             f"{'family':<13}{'single':>8}{'ours':>8}{'mlx-lm pp':>10}{'ours/single':>12}"
             f"{'ours/pp':>9}{'differ':>8}{'RSS/share':>10}{'-mlx':>7}{'-imports':>9}"
             f"{'loaded-imp':>11}"]

    def tps(r: FamilyResult, target: str, runs: list[Stream], width: int) -> str:
        if runs:
            return f"{r.tps(runs):{width}.1f}"
        return f"{'n/a' if target == 'pipeline' and r.no_pipeline else 'failed':>{width}}"

    for r in results:
        ours = [m for m in r.memory if m.who.startswith("ours")]
        to_single, to_pipeline = ratio(r, r.single), ratio(r, r.pipeline)
        differ = f"{r.ours_differ if r.ours else '-'}/{r.pipeline_differ if r.pipeline else '-'}"
        memory = (f"{max(m.rss / m.share for m in ours):10.2f}"
                  f"{max((m.rss - bare.mlx) / m.share for m in ours):7.2f}"
                  f"{max((m.rss - bare.stage) / m.share for m in ours):9.2f}"
                  f"{max(((m.loaded or 0) - bare.stage) / m.share for m in ours):11.2f}"
                  ) if ours else ""
        lines.append(f"{r.family:<13}{tps(r, 'single', r.single, 8)}{tps(r, 'ours', r.ours, 8)}"
                     f"{tps(r, 'pipeline', r.pipeline, 10)}"
                     f"{'-' if to_single is None else f'{to_single:.2f}':>12}"
                     f"{'-' if to_pipeline is None else f'{to_pipeline:.2f}':>9}"
                     f"{differ:>8}{memory}")
    lines.append("(decode tok/s, medians; differ: tokens differing from mlx-lm single, ours/"
                 "mlx-lm pipeline; RSS/share and the rest: the larger of our two stages)")
    return lines


def main() -> None:
    from mlxceld.models.families import SUPPORTED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny fixtures, 8 tokens, 1 run, {','.join(QUICK_FAMILIES)}")
    parser.add_argument("--families", help=f"comma-separated, of: {','.join(SUPPORTED)}")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds each subprocess and each request may take")
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.runs = 8, 1
    families = (args.families.split(",") if args.families
                else list(QUICK_FAMILIES if args.quick else SUPPORTED))
    if args.max_tokens < 2 or args.runs < 1 or args.timeout <= 0:
        parser.error("--max-tokens must be at least 2 (decode is timed from the first "
                     "token to the last), --runs at least 1, --timeout positive")
    unknown = [f for f in families if f not in SUPPORTED]
    if unknown:
        parser.error(f"--families: {', '.join(unknown)} not among {', '.join(SUPPORTED)}")
    settings = Settings(args.quick, args.max_tokens, args.runs, args.timeout)
    print(f"{os.cpu_count()} CPUs, load average at the start "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    started = time.monotonic()

    def work(root: Path) -> None:
        bare = Bare.measure(settings.timeout_s)
        results = run(families, settings, root)
        print(report(results, settings, bare))
        print(f"({time.monotonic() - started:.0f} s)")

    in_scratch("mxfam", work)


if __name__ == "__main__":
    main()
