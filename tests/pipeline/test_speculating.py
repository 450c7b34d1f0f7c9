"""Speculative decoding across a pipeline (``pipeline/speculating.py``) over real stages and
real MXCL: greedy tokens with the last stage's draft are those without it, token for
token, on 2 stages, for a draft that agrees and one that does not, alone and with several
sequences at once, with the prompt cache's turns, with a quantized KV cache; the counters
say how much was accepted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlxceld.engine import GenerationRequest, SamplingParams
from mlxceld.pipeline import PipelineEngine
from mlxceld.roles.options import KVQuant

from helpers.drafts import write_pairs
from helpers.stages import cluster, tokens_of

SPLITS = [(0, 2), (2, 4)]
PROMPTS = [[5, 17, 230, 9, 41], [300, 2, 77], [i * 7 % 400 + 3 for i in range(70)]]
N = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``target/`` (zeroed, untied llama, 4 layers), its agreeing ``draft/``, an
    unrelated ``other/``, and ``plain/``: a random target whose tokens depend on the whole
    context (so a cache trimmed wrong shows), with ``other/`` its draft too."""
    root = tmp_path_factory.mktemp("pipepairs")
    return write_pairs(root, 4)


async def _run(path: Path, draft: Path | None, work: Any, splits: Any = SPLITS,
               kv: KVQuant | None = None, **knobs: Any) -> tuple[Any, dict[str, float] | None]:
    async with cluster(path, splits, draft=draft, **knobs) as c:
        engine = c.engine(path, kv_quant=kv)
        try:
            out = await work(engine)
            spec = c.services[-1].draft
            return out, None if spec is None else {
                **spec.snapshot(), "drafted_ahead": c.services[-1].draft_clock.ahead}
        finally:
            await engine.aclose()


async def _one_by_one(engine: PipelineEngine) -> list[list[int]]:
    return [await tokens_of(engine, prompt, N) for prompt in PROMPTS]


async def _together(engine: PipelineEngine) -> list[list[int]]:
    return list(await asyncio.gather(*(tokens_of(engine, prompt, N) for prompt in PROMPTS)))


@pytest.mark.parametrize("splits", [SPLITS, [(0, 4)], [(0, 1), (1, 3), (3, 4)]])
def test_an_agreeing_draft_gives_the_same_greedy_tokens_and_accepts_them_all(
        pair: Path, splits: Any) -> None:
    plain, _ = asyncio.run(_run(pair / "target", None, _one_by_one, splits))
    ours, stats = asyncio.run(_run(pair / "target", pair / "draft", _one_by_one, splits))
    assert ours == plain
    assert stats is not None and stats["proposed"] > 0
    assert stats["acceptance_rate"] == 1.0
    assert stats["tokens_per_pass"] > 3  # k = 4: up to 5 a pass, less at each end
    # Every pass kept, and the draft's guess after it right: from a sequence's second pass
    # on, its proposals were drafted while the pass before was away, but at its end (not
    # on one stage).
    if len(splits) > 1:
        assert stats["drafted_ahead"] >= stats["passes"] - 2 * len(PROMPTS), stats
    else:
        assert stats["drafted_ahead"] == 0, stats


@pytest.mark.parametrize(("target", "draft", "rates"), [
    ("target", "other", (0.0, 0.5)), ("plain", "other", (0.0, 0.5)),
    # the target as its own draft: long runs accepted, every token read in context
    ("plain", "plain", (0.9, 1.0))])
def test_any_draft_changes_no_token(pair: Path, target: str, draft: str,
                                    rates: tuple[float, float]) -> None:
    plain, _ = asyncio.run(_run(pair / target, None, _one_by_one))
    ours, stats = asyncio.run(_run(pair / target, pair / draft, _one_by_one, k=3))
    assert ours == plain
    assert stats is not None and stats["proposed"] > 0
    assert rates[0] <= stats["acceptance_rate"] <= rates[1]


@pytest.mark.parametrize(("target", "draft"), [("target", "draft"), ("target", "other"),
                                               ("plain", "other")])
def test_several_sequences_at_once_get_their_own_tokens(pair: Path, target: str,
                                                        draft: str) -> None:
    plain, _ = asyncio.run(_run(pair / target, None, _one_by_one))
    ours, stats = asyncio.run(_run(pair / target, pair / draft, _together))
    assert ours == plain
    assert stats is not None


@pytest.fixture(scope="module")
def kv_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pair``'s models with heads of 64 elements: a quantized KV cache fits them."""
    return write_pairs(tmp_path_factory.mktemp("pipekvpairs"), 4, head_dim=64)


async def _with_logprobs(engine: PipelineEngine, prompt: list[int]) -> list[Any]:
    req = GenerationRequest("r", prompt, SamplingParams(max_tokens=N, temperature=0,
                                                        logprobs=0))
    return [(t.token, t.logprob) async for t in engine.generate(req)]


@pytest.mark.parametrize("kv", [KVQuant(8, 64, 0), KVQuant(4, 64, 0), KVQuant(4, 32, 9)],
                         ids=str)
def test_with_kv_bits_a_draft_changes_no_token(kv_pair: Path, kv: KVQuant) -> None:
    """Every stage's caches quantized (from the first token, or from token 9: crossed in
    the prompt by some and while decoding by others): the target as its own draft, one
    by one and then together, gives the tokens and log-probabilities the pipeline gives
    without a draft with the same kv_bits, and they are not full precision's."""
    async def both(engine: PipelineEngine) -> list[list[Any]]:
        alone = [await _with_logprobs(engine, prompt) for prompt in PROMPTS]
        return [*alone, *await asyncio.gather(*(_with_logprobs(engine, prompt)
                                                for prompt in PROMPTS))]

    full, _ = asyncio.run(_run(kv_pair / "plain", None, both))
    plain, _ = asyncio.run(_run(kv_pair / "plain", None, both, kv=kv))
    ours, stats = asyncio.run(_run(kv_pair / "plain", kv_pair / "plain", both, kv=kv, k=3))
    assert [[t for t, _ in s] for s in ours] == [[t for t, _ in s] for s in plain]
    for a, b in zip(ours, plain, strict=True):
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-5)
    assert any(abs(a[1] - b[1]) > 1e-4 for s, f in zip(plain, full, strict=True)
               for a, b in zip(s, f, strict=False))
    assert stats is not None and stats["proposed"] > 0 and stats["accepted"] > 0


def test_a_chat_reusing_the_prompt_cache_gets_the_same_tokens(pair: Path) -> None:
    """Each turn starts from the kept history: a kept entry holds no rejected position."""
    async def turns(engine: PipelineEngine) -> list[list[int]]:
        history = list(PROMPTS[2])
        answers = []
        for _ in range(3):
            answers.append(out := await tokens_of(engine, history, 12))
            history += [*out, 2, 33, 34, 35]
            await asyncio.sleep(0.3)  # the stages' cache answers
        return answers

    plain, _ = asyncio.run(_run(pair / "plain", None, turns))
    ours, stats = asyncio.run(_run(pair / "plain", pair / "other", turns))
    assert ours == plain
    assert stats is not None and stats["proposed"] > 0


def test_sampling_above_temperature_zero_speculates_and_ends(pair: Path) -> None:
    async def sampled(engine: PipelineEngine) -> list[int]:
        req = GenerationRequest("r", PROMPTS[0], SamplingParams(max_tokens=N,
                                                               temperature=0.8))
        return [t.token async for t in engine.generate(req)]

    out, stats = asyncio.run(_run(pair / "target", pair / "draft", sampled))
    assert len(out) == N
    assert stats is not None and stats["passes"] > 0 and stats["accepted"] > 0


def test_drafting_ahead_that_fails_costs_only_its_time(pair: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass drafted ahead that raised (on the draft's thread) is drafted in line instead:
    the tokens are the target's, no pass used it, and the sequences all end."""
    from mlxceld.pipeline import speculating

    def broken(self: speculating.SpecState, base: list[int], k: int) -> Any:
        self._drafted(base, 1)  # the draft's cache moved, as a job cut short may leave it
        raise RuntimeError("drafting ahead broke")

    monkeypatch.setattr(speculating.SpecState, "_ahead", broken)
    plain, _ = asyncio.run(_run(pair / "plain", None, _one_by_one))
    ours, stats = asyncio.run(_run(pair / "plain", pair / "plain", _one_by_one, k=3))
    assert ours == plain
    assert stats is not None and stats["passes"] > 0 and stats["drafted_ahead"] == 0
