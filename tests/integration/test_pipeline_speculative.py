"""Speculative decoding across a pipeline as users run it: daemons from a cluster TOML with
``[cluster] draft_model`` (tests/helpers/pipeline.py), the real ``openai`` client. Greedy
text is mlx-lm's own with a draft on the last stage, one request or several at once; the
last stage's host shows the counters in ``mlxctl status``; a draft of another tokenizer
fails the last stage, named."""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path

import pytest

from mlxceld.models.fixtures import preset, write_fixture

from helpers.daemons import READY_S, Daemons
from helpers.drafts import write_pairs
from helpers.models import expected
from helpers.pipeline import start_pipeline
from helpers.router import client
from helpers.waiting import wait_for

N = 40
STATS_S = 20.0  # a worker's stats reach the daemon's status within a few of its ticks
PROMPTS = ["The quick brown fox", "Hello, world", "Once upon a time"]
SPLITS = [(0, 2), (2, 4)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``target/`` (zeroed) and its agreeing ``draft/``; ``other/`` an unrelated draft;
    ``plain/`` a random target whose tokens wander."""
    root = tmp_path_factory.mktemp("pipespec")
    return write_pairs(root, 4)


def test_greedy_text_is_the_model_s_with_a_draft_alone_and_together(daemons: Daemons,
                                                                    pair: Path) -> None:
    model = pair / "plain"
    pipe = start_pipeline(daemons, model, SPLITS, draft=(model, 3))  # itself: agrees
    want = {p: expected(model, p, N) for p in PROMPTS}
    with client(pipe.url) as c:
        def complete(prompt: str) -> str:
            return c.completions.create(model="plain", prompt=prompt, max_tokens=N,
                                        temperature=0).choices[0].text or ""

        assert {p: complete(p) for p in PROMPTS} == want
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = dict(zip(PROMPTS, pool.map(complete, PROMPTS), strict=True))
        assert together == want
    last = pipe.stages[-1]
    wait_for(lambda: "stage: speculative decoding:" in last.ctl("status").stdout
             and " of 0 draft tokens" not in last.ctl("status").stdout, STATS_S,
             "the last stage's counters in mlxctl status")
    assert "speculative decoding" not in pipe.stages[0].ctl("status").stdout


def test_the_agreeing_pair_accepts_every_proposal(daemons: Daemons, pair: Path) -> None:
    model = pair / "target"
    pipe = start_pipeline(daemons, model, SPLITS, draft=(pair / "draft", 4))
    with client(pipe.url) as c:
        text = c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=N,
                                    temperature=0).choices[0].text
    assert text == expected(model, PROMPTS[0], N)
    status = wait_for(lambda: (out := pipe.stages[-1].ctl("status").stdout)
                      and "draft tokens accepted (100%)" in out and out, STATS_S,
                      "the counters in the last stage's mlxctl status")
    # every pass after the first had its proposals drafted while the one before was away
    assert re.search(r"tokens a pass, [1-9]\d* drafted ahead", status), status


def test_a_draft_of_another_tokenizer_fails_the_last_stage_by_name(
        daemons: Daemons, pair: Path, tmp_path: Path) -> None:
    other = write_fixture(tmp_path / "v600", preset("tiny", family="llama", layers=1,
                                                    vocab=600))
    pipe = start_pipeline(daemons, pair / "plain", SPLITS, draft=(other, 4),
                          stage_models={1: pair / "plain"})
    worker = pipe.stages[-1].wait_worker("stage", timeout=READY_S, state="failed")
    said = str(worker)
    assert "failed to load its draft model" in said and "vocabulary of 600 tokens" in said, \
        said
