"""Speculative decoding in the local engine (``engine/speculative.py``): the rejection
rule keeps the target's distribution (statistically, on a small vocabulary), greedy
tokens with a draft are the target's own whatever the draft proposes (with a quantized KV
cache too: those without a draft with the same kv_bits), and the counters say how much
was accepted: all of the agreeing pair's proposals, few of an unrelated draft's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxceld.engine import GenerationRequest, SamplingParams, TokenOutput
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.engine.speculative import accept, accept_greedy, accept_sampled, propose
from mlxceld.errors import ConfigError
from mlxceld.models.fixtures import preset, unrelated_draft, write_fixture
from mlxceld.roles.options import KVQuant

from helpers.drafts import write_pairs

PROMPTS = ["Hello, world", "The quick brown fox jumps over", "x"]
N = 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``target/`` (zeroed, untied llama), its agreeing ``draft/``, an unrelated ``other/``,
    and ``plain/``: a random target whose greedy tokens wander (no draft agrees by
    construction), with ``other/`` usable as its draft too."""
    root = tmp_path_factory.mktemp("pairs")
    return write_pairs(root, 3)


@pytest.fixture(scope="module")
def kv_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pair``'s models with heads of 64 elements: a quantized KV cache fits them."""
    return write_pairs(tmp_path_factory.mktemp("kvpairs"), 3, head_dim=64)


def test_greedy_acceptance_is_the_longest_agreeing_run() -> None:
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == 2
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accept_greedy([1, 2], [3]) == 0
    assert accept_greedy([4], []) == 0


def test_the_drafts_greedy_pick_breaks_bfloat16_ties_as_the_targets_does(
        tmp_path: Path) -> None:
    """A zeroed bfloat16 model as its own draft, one token of every id: its proposal is
    the token ``accept`` reads as the target's. In bfloat16 some logits a ulp apart round
    to one log-probability (here more than one id's argmax on raw logits is another):
    a draft reading raw logits proposed those, and the agreeing pair kept ~96 %."""
    spec = preset("tiny", family="llama", dtype="bfloat16", zero_out=True)
    model = load(str(write_fixture(tmp_path / "m", spec)))[0]
    raw_differs = 0
    for token in range(spec.vocab):
        y = mx.array([token], dtype=mx.uint32)
        [proposed], _ = propose(model, y, make_prompt_cache(model), 1, None)
        logits = model(y[None], cache=make_prompt_cache(model))[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        assert accept(logprobs, [], [], None)[1] == proposed.item(), token
        raw_differs += int(mx.argmax(logits, axis=-1).item() != proposed.item())
    assert raw_differs > 0  # the fixture has ties for the rule to break


def _tv(counts: list[int], p: list[float]) -> float:
    total = sum(counts)
    return 0.5 * sum(abs(c / total - pi) for c, pi in zip(counts, p, strict=True))


def test_the_rejection_rule_keeps_the_target_distribution() -> None:
    """Each emitted position is distributed as the target's ``p`` at it, although the
    proposals come from a rather different ``q`` (which a rule that trusted the draft
    would give instead)."""
    p = mx.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25]])
    q = mx.array([[0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    mx.random.seed(7)
    trials = 6000
    drafted = mx.random.categorical(mx.log(q)[None], shape=(trials, 2)).tolist()
    uniforms = mx.random.uniform(shape=(trials, 3))
    first, second = [0] * 4, [0] * 4
    accepted = 0
    for i in range(trials):
        d: list[int] = drafted[i]  # type: ignore[index,assignment]
        n, token = accept_sampled(p, q, d, uniforms[i])
        emitted = [*d[:n], token]
        accepted += n
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    p_rows: list[list[float]] = p.tolist()  # type: ignore[assignment]
    assert _tv(first, p_rows[0]) < 0.03
    assert _tv(second, p_rows[1]) < 0.04
    assert sum(second) > trials // 4  # the second position was reached often enough
    assert _tv(first, q.tolist()[0]) > 0.3  # type: ignore[index,arg-type]
    # The expected acceptance of the first proposal is sum(min(p, q)) = 0.6.
    assert 0.5 < accepted / trials < 1.3


async def _tokens(engine: LocalEngine, prompt: list[int], n: int = N,
                  **params: Any) -> list[TokenOutput]:
    req = GenerationRequest("t", prompt, SamplingParams(max_tokens=n, **params))
    return [t async for t in engine.generate(req)]


def _run(target: Path, draft: Path | None, job: Any, k: int = 4,
         kv: KVQuant | None = None, prompt_cache_bytes: int = 0) -> tuple[Any, Any]:
    async def main() -> tuple[Any, Any]:
        engine, _ = load_local_engine(str(target), max_batch=4,
                                      draft_model=None if draft is None else str(draft),
                                      num_draft_tokens=k, kv_quant=kv,
                                      prompt_cache_bytes=prompt_cache_bytes)
        try:
            return await job(engine), None if engine.draft is None \
                else engine.draft.snapshot()
        finally:
            await engine.aclose()
    return asyncio.run(main())


@pytest.mark.parametrize(("target", "draft", "rate"), [
    ("target", "draft", (1.0, 1.0)), ("target", "other", (0.0, 0.5)),
    ("plain", "other", (0.0, 0.5)),
    # The target as its own draft: its context (its cache, trimmed pass after pass) must
    # be right for every proposal to be: the zeroed pair's draft reads the last token only.
    ("plain", "plain", (1.0, 1.0))])
def test_greedy_with_a_draft_is_greedy_without(pair: Path, target: str, draft: str,
                                                rate: tuple[float, float]) -> None:
    tokenizer = load(str(pair / target))[1]
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    async def alone(engine: LocalEngine) -> list[list[TokenOutput]]:
        return [await _tokens(engine, p, temperature=0, logprobs=2) for p in prompts]

    want, _ = _run(pair / target, None, alone)
    got, stats = _run(pair / target, pair / draft, alone)
    assert [[t.token for t in s] for s in got] == [[t.token for t in s] for s in want]
    for ours, theirs in zip(got, want, strict=True):  # the target's logprobs, as without
        for a, b in zip(ours, theirs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
    assert len({t.token for t in want[1]}) > 1 or target == "target"
    assert stats["proposed"] > 0 and stats["passes"] > 0
    assert rate[0] <= stats["acceptance_rate"] <= rate[1]
    assert stats["tokens"] <= sum(len(s) for s in got)  # plain passes are not counted
    if rate[0] == 1.0:  # k accepted and one more, each pass but the last ones
        assert stats["tokens_per_pass"] > 4


def test_several_sequences_at_once_equal_each_alone(pair: Path) -> None:
    """The first sequence speculates until the others arrive, then joins their batch."""
    tokenizer = load(str(pair / "plain"))[1]
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    async def together(engine: LocalEngine) -> list[list[int]]:
        first = asyncio.create_task(_tokens(engine, prompts[0], temperature=0))
        await asyncio.sleep(0.05)  # it has started, alone
        rest = await asyncio.gather(*(_tokens(engine, p, temperature=0) for p in prompts[1:]))
        return [[t.token for t in s] for s in [await first, *rest]]

    async def alone(engine: LocalEngine) -> list[list[int]]:
        return [[t.token for t in await _tokens(engine, p, temperature=0)] for p in prompts]

    want, _ = _run(pair / "plain", None, alone)
    got, stats = _run(pair / "plain", pair / "other", together)
    assert got == want
    assert stats["passes"] > 0  # the first one did speculate


def test_sampling_with_a_draft(pair: Path) -> None:
    """Temperature above 0: tokens come, every proposal of the agreeing draft at
    temperature 1 is accepted or not by the rule (the counters move); a seeded request
    does not speculate."""
    tokenizer = load(str(pair / "target"))[1]
    prompt = tokenizer.encode(PROMPTS[1])

    async def sample(engine: LocalEngine) -> tuple[list[TokenOutput], list[TokenOutput]]:
        free = await _tokens(engine, prompt, temperature=0.8, top_k=50)
        assert engine.draft is not None
        before = engine.draft.snapshot()["passes"]
        seeded = await _tokens(engine, prompt, temperature=0.8, seed=3)
        assert engine.draft.snapshot()["passes"] == before
        return free, seeded

    (free, seeded), stats = _run(pair / "target", pair / "draft", sample)
    assert len(free) == N or free[-1].finish_reason == "stop"
    assert seeded and all(0 <= t.token < 512 for t in seeded)
    assert stats["proposed"] > 0
    assert stats["acceptance_rate"] > 0.9  # the same distribution at each step: p == q


def test_a_draft_of_another_tokenizer_is_refused(pair: Path, tmp_path: Path) -> None:
    write_fixture(tmp_path / "v600", preset("tiny", family="llama", layers=1, vocab=600))
    with pytest.raises(ConfigError, match=r"serve\.draft_model: draft model .* vocabulary"):
        load_local_engine(str(pair / "target"), draft_model=str(tmp_path / "v600"))
    # The same vocabulary size, other tokens: a tokenizer trained for 600, cut to 512.
    write_fixture(tmp_path / "t600", preset("tiny", family="llama", layers=1,
                                             tokenizer_vocab=300))
    with pytest.raises(ConfigError, match=r"tokenizer \(tokenizer\.json\) is not"):
        load_local_engine(str(pair / "target"), draft_model=str(tmp_path / "t600"))


def test_a_model_whose_cache_cannot_be_trimmed_is_refused(tmp_path: Path) -> None:
    target = preset("tiny", family="gemma3_text", layers=2)
    write_fixture(tmp_path / "gemma", target)
    write_fixture(tmp_path / "draft", unrelated_draft(target))
    with pytest.raises(ConfigError, match=r"serve\.draft_model: model family 'gemma3_text' .*"
                                          r"cannot be trimmed"):
        load_local_engine(str(tmp_path / "gemma"), draft_model=str(tmp_path / "draft"))


def test_a_speculated_sequence_feeds_the_prompt_cache(pair: Path) -> None:
    """Its cache is kept as it ends; the same prompt again prefills only its last token, and
    speculates from there to the same tokens."""
    tokenizer = load(str(pair / "plain"))[1]
    prompt = tokenizer.encode(PROMPTS[1])

    async def twice(engine: LocalEngine) -> list[list[TokenOutput]]:
        return [await _tokens(engine, prompt, temperature=0) for _ in range(2)]

    async def main() -> tuple[list[list[TokenOutput]], dict[str, float]]:
        engine, _ = load_local_engine(str(pair / "plain"), max_batch=2,
                                      draft_model=str(pair / "other"))
        try:
            outs = await twice(engine)
            assert engine.draft is not None
            return outs, engine.draft.snapshot()
        finally:
            await engine.aclose()

    (first, second), stats = asyncio.run(main())
    assert [t.token for t in first] == [t.token for t in second]
    assert first[0].cached == 0 and second[0].cached == len(prompt) - 1
    assert stats["passes"] > 0


def test_a_sequence_alone_again_speculates_again(pair: Path) -> None:
    """A speculating sequence joins the batch when a second arrives, and once that one is
    done leaves the batch to speculate again, from the batch's cache: its tokens are still
    the target's own (the target as its own draft: every token depends on the context, so
    a cache taken back wrongly would show)."""
    tokenizer = load(str(pair / "plain"))[1]
    first, second = (tokenizer.encode(p) for p in PROMPTS[:2])

    async def overlapped(engine: LocalEngine) -> tuple[list[int], list[int], int]:
        assert engine.draft is not None
        req = GenerationRequest("a", first, SamplingParams(max_tokens=120, temperature=0))
        tokens: list[int] = []
        other: asyncio.Task[list[TokenOutput]] | None = None
        passes_then = -1
        async for out in engine.generate(req):
            tokens.append(out.token)
            if len(tokens) == 3:
                other = asyncio.create_task(_tokens(engine, second, n=4, temperature=0))
            if other is not None and other.done() and passes_then < 0:
                passes_then = int(engine.draft.snapshot()["passes"])
        assert other is not None
        return tokens, [t.token for t in await other], passes_then

    async def alone(engine: LocalEngine) -> tuple[list[int], list[int]]:
        a = await _tokens(engine, first, n=120, temperature=0)
        b = await _tokens(engine, second, n=4, temperature=0)
        return [t.token for t in a], [t.token for t in b]

    want, _ = _run(pair / "plain", None, alone)
    (a, b, passes_then), stats = _run(pair / "plain", pair / "plain", overlapped)
    assert (a, b) == want
    assert passes_then >= 0, "the second sequence ended after the first"
    assert stats["passes"] > passes_then  # it speculated again once alone
    assert stats["acceptance_rate"] == 1.0


# 8 and 4 bits from the first token; 4 bits in groups of 32 from token 9, crossed in the
# prompt by some and while decoding by others: a pass never runs past it unquantized.
KV_CASES = [KVQuant(8, 64, 0), KVQuant(4, 64, 0), KVQuant(4, 32, 9)]


@pytest.mark.parametrize("kv", KV_CASES, ids=str)
@pytest.mark.parametrize("draft", ["plain", "other"])
def test_greedy_with_a_draft_and_kv_bits_is_greedy_without(kv_pair: Path, kv: KVQuant,
                                                           draft: str) -> None:
    """With ``kv_bits`` the speculating sequence's cache is quantized as the batch's:
    tokens and log-probabilities are those without a draft with the same ``kv_bits``
    (the target as its own draft reads its whole context, so a cache trimmed or
    quantized wrong shows), and they are not full precision's."""
    tokenizer = load(str(kv_pair / "plain"))[1]
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [[3 + i * 7 % 240 for i in range(40)]]

    async def alone(engine: LocalEngine) -> list[list[TokenOutput]]:
        return [await _tokens(engine, p, temperature=0, logprobs=0) for p in prompts]

    full, _ = _run(kv_pair / "plain", None, alone)
    want, _ = _run(kv_pair / "plain", None, alone, kv=kv)
    got, stats = _run(kv_pair / "plain", kv_pair / draft, alone, kv=kv)
    assert [[t.token for t in s] for s in got] == [[t.token for t in s] for s in want]
    for ours, theirs in zip(got, want, strict=True):
        assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs],
                                                          abs=1e-5)
    assert any(abs((a.logprob or 0) - (b.logprob or 0)) > 1e-4
               for s, f in zip(got, full, strict=True) for a, b in zip(s, f, strict=False))
    assert stats["passes"] > 0 and stats["proposed"] > 0
    if draft == "plain":  # its own tokens: most proposals kept, whatever kv_bits does
        assert stats["accepted"] > 0


def test_with_kv_bits_a_speculated_sequence_joins_the_batch_and_the_prompt_cache(
        kv_pair: Path) -> None:
    """The first sequence speculates, then joins the others' batch with its quantized
    cache; then the same prompt again starts from the kept (quantized) cache: every
    sequence's tokens are its tokens alone without a draft."""
    kv = KV_CASES[1]
    tokenizer = load(str(kv_pair / "plain"))[1]
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    async def together(engine: LocalEngine) -> tuple[list[list[int]], list[TokenOutput]]:
        first = asyncio.create_task(_tokens(engine, prompts[0], temperature=0))
        await asyncio.sleep(0.05)  # it has started, alone
        rest = await asyncio.gather(*(_tokens(engine, p, temperature=0) for p in prompts[1:]))
        again = await _tokens(engine, prompts[1], temperature=0)  # alone: it speculates
        return [[t.token for t in s] for s in [await first, *rest]], again

    async def alone(engine: LocalEngine) -> list[list[int]]:
        return [[t.token for t in await _tokens(engine, p, temperature=0)] for p in prompts]

    want, _ = _run(kv_pair / "plain", None, alone, kv=kv)
    (got, again), stats = _run(kv_pair / "plain", kv_pair / "other", together, kv=kv,
                               prompt_cache_bytes=1 << 26)
    assert got == want
    assert [t.token for t in again] == want[1]
    assert again[0].cached == len(prompts[1]) - 1  # from the prompt cache
    assert stats["passes"] > 0


def test_a_backed_off_draft_runs_only_when_it_proposes(pair: Path) -> None:
    """While the pacing runs plain passes the draft is left behind (it catches up on its
    next proposal): an unrelated draft runs a few times per probe, not once a token."""
    tokenizer = load(str(pair / "plain"))[1]
    prompt = tokenizer.encode(PROMPTS[1])
    calls = [0]

    class Counted:
        def __init__(self, model: Any) -> None:
            self._model = model

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return self._model(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._model, name)

    async def main() -> tuple[list[TokenOutput], list[TokenOutput], dict[str, float]]:
        engine, _ = load_local_engine(str(pair / "plain"), max_batch=2, prompt_cache_bytes=0,
                                      draft_model=str(pair / "other"))
        plain, _ = load_local_engine(str(pair / "plain"), max_batch=2)
        try:
            assert engine.draft is not None
            engine.draft.model = Counted(engine.draft.model)
            ours = await _tokens(engine, prompt, 200, temperature=0)
            want = await _tokens(plain, prompt, 200, temperature=0)
            return ours, want, engine.draft.snapshot()
        finally:
            await engine.aclose()
            await plain.aclose()

    ours, want, stats = asyncio.run(main())
    assert [t.token for t in ours] == [t.token for t in want]
    assert len(ours) > 150, len(ours)  # a long run: mostly plain passes once backed off
    # the probes' proposals (k = 4 a pass) and their catch-ups, not a call per token
    assert calls[0] <= stats["proposed"] + 2 * stats["passes"] + 2, (calls, stats)
