"""Sampling controls and logprobs with the real ``openai`` client against real daemons: one
serving the model itself (the local engine), and a 2-stage pipeline (the last stage
samples). Each is started once for this module; the tokens are checked against mlx-lm's
own steps on the whole model, with our logits processors where a request asks for them."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import openai
import pytest
from mlx_lm.generate import generate_step

from mlxceld.api import MlxTextCodec
from mlxceld.api.logprobs import token_name
from mlxceld.engine import SamplingParams
from mlxceld.engine.processors import make_logits_processors

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.models import PROMPT
from helpers.pipeline import start_pipeline
from helpers.ports import free_port
from helpers.router import client

FAMILY = "llama"
REPEATS = "ototot"  # greedy on the llama split fixture: one token 23 times in 24


@pytest.fixture(scope="module", params=["local", "pipeline"])
def served(request: pytest.FixtureRequest, split_fixture_dir: Path
           ) -> Iterator[tuple[str, Path]]:
    """The OpenAI URL of a router over ``split_fixture_dir``'s llama, and the model."""
    model = split_fixture_dir / FAMILY
    daemons = Daemons()
    try:
        if request.param == "pipeline":
            url = start_pipeline(daemons, model, [(0, 2), (2, 4)]).url
        else:
            port = free_port("127.0.0.1")
            host = Host(daemons, "lo", secret=None,
                        serve={"model": str(model), "port": port}).start()
            daemons.pids.add(host.d.wait_worker("router", timeout=READY_S,
                                                state="running")["pid"])
            url = f"http://127.0.0.1:{port}/v1"
        yield url, model
    finally:
        daemons.cleanup()


def reference(model: Path, prompt: str, n: int, **params: Any
              ) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's greedy tokens and log-probabilities on the whole model, through our
    processors for ``params``."""
    m, tok = mlx_lm.load(str(model))[:2]
    processors = make_logits_processors(SamplingParams(max_tokens=n, **params),
                                        tok.eos_token_ids)
    steps = list(generate_step(mx.array(tok.encode(prompt)), m, max_tokens=n,
                               logits_processors=processors))
    return [int(t) for t, _ in steps], [lp for _, lp in steps]


def names(model: Path, tokens: list[int]) -> list[str]:
    codec = MlxTextCodec(mlx_lm.load(str(model))[1])
    return [token_name(codec.token_bytes(t)) for t in tokens]


def test_logprobs_are_mlx_lms(served: tuple[str, Path]) -> None:
    url, model = served
    ref_tokens, ref_logprobs = reference(model, PROMPT, 8)
    with client(url) as c:
        comp = c.completions.create(model=FAMILY, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logprobs=5)
        stream = c.completions.create(model=FAMILY, prompt=PROMPT, max_tokens=8,
                                      temperature=0, logprobs=5, stream=True)
        chunks = [ch.choices[0].logprobs for ch in stream if ch.choices]
        chat = c.chat.completions.create(model=FAMILY, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3,
                                         messages=[{"role": "user", "content": "Hi"}])
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens == names(model, ref_tokens)
    for i, (token, row) in enumerate(zip(ref_tokens, ref_logprobs, strict=True)):
        assert lp.token_logprobs[i] == pytest.approx(row[token].item(), abs=1e-4)
        top = sorted(row.tolist(), reverse=True)[:5]
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == \
            pytest.approx(top[:len(lp.top_logprobs[i])], abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = [t for s in chunks if s for t in s.tokens or []]
    assert streamed == lp.tokens
    content = chat.choices[0].logprobs
    assert content is not None and content.content
    for entry in content.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy: the most likely
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0


def test_penalties_and_logit_bias(served: tuple[str, Path]) -> None:
    url, model = served

    def tokens(**extra: Any) -> list[str]:
        with client(url) as c:
            lp = c.completions.create(model=FAMILY, prompt=REPEATS, max_tokens=24,
                                      temperature=0, logprobs=0,
                                      extra_body=extra).choices[0].logprobs
        assert lp is not None and lp.tokens is not None
        return lp.tokens

    plain = tokens()
    assert len(set(plain)) < len(plain) // 2, plain  # a prompt the fixture repeats on
    assert tokens(frequency_penalty=0, presence_penalty=0, repetition_penalty=1) == plain
    for controls in ({"frequency_penalty": 2.0}, {"presence_penalty": 1.5},
                     {"repetition_penalty": 1.8}):
        got = tokens(**controls)
        assert got == names(model, reference(model, REPEATS, 24, **controls)[0]), controls
        assert got != plain, controls
    assert len(set(tokens(frequency_penalty=2.0))) > len(set(plain))  # fewer repeats
    # +100 on one token forces it, at a log-probability of about 0
    forced = MlxTextCodec(mlx_lm.load(str(model))[1]).token_bytes(300)
    with client(url) as c:
        lp = c.completions.create(model=FAMILY, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=0, logit_bias={"300": 100}).choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert lp.tokens == [token_name(forced)] * 5
    assert all(v > -1e-3 for v in lp.token_logprobs)


def test_min_tokens_and_ignore_eos_hold_back_an_eos_made_likely(
        served: tuple[str, Path]) -> None:
    """+100 on the end-of-sequence token ends a greedy answer at once; vLLM's ``min_tokens``
    holds it back until that many tokens were generated, ``ignore_eos`` to max_tokens."""
    url, model = served
    [eos, *_] = sorted(mlx_lm.load(str(model))[1].eos_token_ids)

    def finish(**extra: Any) -> tuple[str | None, int]:
        with client(url) as c:
            answer = c.completions.create(model=FAMILY, prompt=PROMPT, max_tokens=8,
                                          temperature=0, logit_bias={str(eos): 100},
                                          extra_body=extra)
        assert answer.usage is not None
        return answer.choices[0].finish_reason, answer.usage.completion_tokens

    assert finish() == ("stop", 1)  # usage counts the end-of-sequence token
    assert finish(min_tokens=5) == ("stop", 6)
    assert finish(min_tokens=8) == ("length", 8)
    assert finish(ignore_eos=True) == ("length", 8)
    with client(url) as c:
        chunks = list(c.chat.completions.create(
            model=FAMILY, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            temperature=0, logit_bias={str(eos): 100}, stream=True,
            stream_options={"include_usage": True}, extra_body={"min_tokens": 3}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 4
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


def test_seeded_sampling_alone_and_in_a_batch(served: tuple[str, Path]) -> None:
    url, _ = served

    def sample(seed: int, prompt: str = PROMPT) -> str:
        with client(url) as c:
            text: str = c.completions.create(
                model=FAMILY, prompt=prompt, max_tokens=12, temperature=1.0, seed=seed,
                extra_body={"top_k": 50, "min_p": 0.05}).choices[0].text
            return text

    alone = sample(42)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(sample, [42, 7, -1, 42], [PROMPT, "Hello", PROMPT, PROMPT]))
    assert together[0] == together[3] == alone
    assert sample(-1) == together[2]  # OpenAI's seed is signed


@pytest.mark.parametrize(("extra", "param"), [
    ({"logit_bias": {"99999": 5}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": 6}, "logprobs"),
    ({"min_p": -0.5}, "min_p"),
])
def test_bad_values_are_refused_naming_the_field(served: tuple[str, Path],
                                                 extra: dict[str, Any], param: str) -> None:
    url, _ = served
    with client(url) as c, pytest.raises(openai.BadRequestError) as caught:
        c.completions.create(model=FAMILY, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body.get("param") == param
