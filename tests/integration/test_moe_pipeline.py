"""A mixture-of-experts model served by a pipeline of real daemons (127.0.0.1 coordinator,
.2 and .3 stages, tests/helpers/pipeline.py), driven by the real `openai` client: the
stages' greedy output is mlx-lm's, alone and with requests batched together."""

from __future__ import annotations

import threading

import pytest

from mlxceld.models import preset, write_fixture

from helpers.daemons import Daemons
from helpers.models import expected
from helpers.pipeline import start_pipeline
from helpers.router import client

PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "1 2 3"]


def test_qwen3_moe_over_an_uneven_split_equals_mlx_lm(daemons: Daemons,
                                                      tmp_path_factory: pytest.TempPathFactory
                                                      ) -> None:
    model = write_fixture(tmp_path_factory.mktemp("moe") / "qwen3_moe",
                          preset("tiny", family="qwen3_moe", layers=4))
    pipe = start_pipeline(daemons, model, [(0, 1), (1, 4)])
    want = {p: expected(model, p, 12) for p in PROMPTS}
    results: dict[str, str] = {}

    def one(prompt: str) -> None:
        with client(pipe.url) as c:
            stream = c.completions.create(model="qwen3_moe", prompt=prompt, max_tokens=12,
                                          temperature=0, stream=True)
            results[prompt] = "".join(ch.choices[0].text for ch in stream if ch.choices)

    one(PROMPTS[0])
    assert results == {PROMPTS[0]: want[PROMPTS[0]]}
    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # each is a few tenths of a second; generous on a loaded machine
    assert results == want
