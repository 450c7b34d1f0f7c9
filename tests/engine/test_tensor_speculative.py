"""Speculative decoding in a tensor-parallel group (engine/solo.py): rank 0 drafts, both
ranks run each verify pass and trim their caches alike. Real rank processes on loopback
(``helpers.tensor_ranks``), as tests/engine/test_tensor.py runs them.

Greedy output with a draft at tp 2 is one process's without a draft, token for token, for
a sequence alone (it speculates), for several at once (the speculating one joins the
batch, and the batch's last one leaves it to speculate again: ``spec_back``), after a
cancelled speculating sequence, with the prompt cache in play, over more than one
prefill chunk; sampled sequences speculate too. Two pairs: the agreeing
one (every proposal accepted: the ranks trim and extend by whole runs) and a random
target with an unrelated draft (its tokens depend on the whole context, so a rank whose
cache was trimmed wrongly would give other tokens), that one also with a quantized KV
cache (``kv_bits``) against one process with the same.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mlxceld.engine.loading import load_local_engine
from mlxceld.roles.options import KVQuant

from helpers.drafts import write_pairs
from helpers.tensor_ranks import finish, generated, start_ranks

LOGPROB_TOLERANCE = 1e-4  # as tests/engine/test_tensor.py's
LONG = [3 + (i * 7) % 240 for i in range(600)]  # more than one prefill chunk (512)
REQUESTS: list[dict[str, Any]] = [
    {"prompt": [5, 6, 7, 8, 9], "max_tokens": 24, "temperature": 0},
    {"prompt": [5, 6, 7, 8, 9, 1], "max_tokens": 16, "temperature": 0, "logprobs": 2},
    {"prompt": [30, 31, 32], "max_tokens": 40, "temperature": 0, "cancel_after": 3},
    {"prompt": LONG, "max_tokens": 8, "temperature": 0},
    {"prompt": [10, 11, 12], "max_tokens": 12, "temperature": 0.8},
    {"prompt": [5, 6, 7, 8, 9], "max_tokens": 30, "temperature": 0},  # round 1's, cached
]
ORDERS = ["one", "all", "one"]  # alone (speculating), at once (joining), alone again


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # heads of 64 elements: a quantized KV cache fits (groups of 32 or 64)
    return write_pairs(tmp_path_factory.mktemp("tp-pairs"), 2, head_dim=64)


def one_process(model: Path, kv: KVQuant | None) -> list[dict[str, Any]]:
    """Each request alone on one process's engine, without a draft."""
    engine, _ = load_local_engine(str(model), max_batch=4, kv_quant=kv)

    async def run() -> list[dict[str, Any]]:
        try:
            return [await generated(engine, i, r) for i, r in enumerate(REQUESTS)]
        finally:
            await engine.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize(("target", "draft", "kv"), [
    ("target", "draft", None), ("plain", "other", None),
    # Rank 0's kv_quant (its setup op): every rank's speculating caches quantize alike,
    # a pass bounded by quantized_kv_start (speculative.plain_room).
    ("plain", "other", KVQuant(4, 32, 9))])
def test_two_ranks_with_a_draft_generate_what_one_process_does_without(
        pairs: Path, target: str, draft: str, kv: KVQuant | None, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    more = {} if kv is None else {"kv": {"bits": kv.bits, "group_size": kv.group_size,
                                         "start": kv.start}}
    procs = start_ranks(pairs / target, 2, REQUESTS, out, orders=ORDERS,
                        draft=str(pairs / draft), **more)
    for rank, (code, text) in enumerate(finish(procs)):
        assert code == 0, f"rank {rank} exited {code}:\n{text[-3000:]}"
    got = json.loads(out.read_text())
    want = one_process(pairs / target, kv)
    if kv is not None:  # the quantized cache changes the tokens: it is in play
        assert [w["tokens"] for w in want] != [w["tokens"] for w in one_process(
            pairs / target, None)]
    for r, tp_round in enumerate(got["rounds"]):
        for i, (tp, one) in enumerate(zip(tp_round, want, strict=True)):
            request = REQUESTS[i]
            if request["temperature"] > 0:  # sampled: its own draws, as many as asked
                assert 0 < len(tp["tokens"]) <= request["max_tokens"], (r, i)
                continue
            assert tp["tokens"] == one["tokens"], f"round {r} ({ORDERS[r]}), request {i}"
            if request.get("logprobs") is not None:
                assert max(abs(a - b) for a, b in zip(tp["logprobs"], one["logprobs"],
                                                      strict=True)) < LOGPROB_TOLERANCE
        assert len(tp_round[2]["tokens"]) == 3  # cancelled; the group went on
    stats = got["speculation"]
    assert stats["passes"] > 0 and stats["proposed"] > 0, stats
    if draft == "draft":  # the agreeing pair: whole runs accepted
        assert stats["acceptance_rate"] > 0.9 and stats["tokens_per_pass"] > 3, stats
