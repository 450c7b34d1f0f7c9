"""Speculative decoding across a pipeline whose stages are tensor-parallel groups (issue 32's
2D mesh; ``pipeline/tensor_stage.py``, ``pipeline/speculating.py``), over real stage
workers, two ranks a stage (tests/helpers/mesh_stages.py), and real MXCL: the last
stage's rank 0 drafts, every rank of every stage trims its cache to each pass's position
and runs the pass. Greedy tokens with the draft are those without it, token for token,
one request at a time and several at once, for a draft that agrees and for an unrelated
one over a random target; a sequence sampled above temperature 0 speculates and ends;
the counters say the draft proposed, and each follower ran the passes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mlxceld.roles.options import KVQuant
from mlxceld.workers.stage import STATS_EVERY_S

from helpers.drafts import write_pairs
from helpers.mesh_stages import greedy_tokens, mesh_stages, sampled_tokens
from helpers.waiting import wait_for

SPLITS = [(0, 2), (2, 4)]
PROMPTS = [[5, 17, 230, 9, 41], [300, 2, 77], [i * 7 % 400 + 3 for i in range(40)]]
N = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("meshpairs"), 4)


@pytest.fixture(scope="module")
def kv_pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pair``'s with heads of 64 elements: a quantized KV cache fits them."""
    return write_pairs(tmp_path_factory.mktemp("meshkvpairs"), 4, head_dim=64)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("target", "draft", "tensor", "rates"), [
    ("target", "draft", {0, 1}, (1.0, 1.0)),  # 2 x 2: both stages groups
    ("plain", "other", {0, 1}, (0.0, 0.5)),
    ("plain", "other", {1}, (0.0, 0.5)),  # only the last stage a group
])
def test_greedy_tokens_with_a_draft_are_those_without(
        pair: Path, state_dir: Path, target: str, draft: str, tensor: set[int],
        rates: tuple[float, float]) -> None:
    model = pair / target
    with mesh_stages(state_dir / "plain", model, SPLITS, tensor=tensor) as mesh:
        plain, plain_together = greedy_tokens(mesh, PROMPTS, N)
    assert plain_together == plain
    with mesh_stages(state_dir / "spec", model, SPLITS, tensor=tensor,
                     draft=pair / draft, k=3) as mesh:
        alone, together = greedy_tokens(mesh, PROMPTS, N)
        time.sleep(1.5 * STATS_EVERY_S)  # the worker's stats, updated at that pace
        spec = mesh.stats("1/stage")["speculative"]
        # above temperature 0 rank 0 accepts by the rejection rule; the ranks go on alike
        sampled = sampled_tokens(mesh, PROMPTS[0], N, 0.8)
        passes = wait_for(lambda: (n := mesh.stats("1/stage")["speculative"]["passes"])
                          > spec["passes"] and n, 10.0, "the sampled sequence's passes",
                          every=0.3)
        keys = [key for key in mesh.specs if key.endswith("/stage-tp-1")]
        # each follower frees a sequence at rank 0's next share (its beat, 0.5 s)
        followers = wait_for(lambda: (got := {k: mesh.stats(k)["tensor"] for k in keys})
                             and all(f["sequences"] == 0 for f in got.values()) and got,
                             10.0, "the followers to free every sequence", every=0.3)
        logs = mesh.logs()
    assert alone == plain, logs
    assert together == plain, logs
    assert spec["proposed"] > 0 and spec["passes"] > 0, spec
    assert rates[0] <= spec["acceptance_rate"] <= rates[1], spec
    assert len(sampled) == N, (sampled, passes, spec)
    assert set(followers) == {f"{i}/stage-tp-1" for i in tensor}
    assert all(f["steps"] > 0 for f in followers.values()), followers


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kv", [KVQuant(4, 32, 0), KVQuant(4, 32, 9)], ids=str)
def test_with_kv_bits_greedy_tokens_with_a_draft_are_those_without(
        kv_pairs: Path, state_dir: Path, kv: KVQuant) -> None:
    """The router's kv_bits (each ``prepare``'s ``kv``) over a last stage that is a group:
    every rank's caches quantize alike, trimmed back pass after pass, a pass never past
    quantized_kv_start at full precision (``plain_room``, rank 0's): the tokens are those
    without a draft with the same cache, which are not full precision's. Several at once
    only from ``start`` 0: above it a batch quantizes a row when its longest row is due
    (``engine/kvquant.py``), so batched tokens may differ from alone ones by design."""
    model = kv_pairs / "plain"
    with mesh_stages(state_dir / "plain", model, SPLITS, tensor={1}) as mesh:
        full, _ = greedy_tokens(mesh, PROMPTS, N)
        plain, plain_together = greedy_tokens(mesh, PROMPTS, N, kv_quant=kv)
    with mesh_stages(state_dir / "spec", model, SPLITS, tensor={1},
                     draft=kv_pairs / "plain", k=3) as mesh:
        alone, together = greedy_tokens(mesh, PROMPTS, N, kv_quant=kv)
        time.sleep(1.5 * STATS_EVERY_S)  # the worker's stats, updated at that pace
        spec = mesh.stats("1/stage")["speculative"]
        logs = mesh.logs()
    assert plain != full  # the quantized cache is in play
    assert alone == plain, logs
    if kv.start == 0:
        assert together == plain_together == plain, logs
    assert spec["passes"] > 0 and spec["acceptance_rate"] > 0.5, spec
