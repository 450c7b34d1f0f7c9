"""A pipeline stage as a tensor-parallel group (pipeline/tensor_stage.py), with real rank
processes on loopback joined in an ``mx.distributed`` ring: the tiny llama fixture split
into two stages chained in rank 0's process, one of them (the first, or the last) a group
of 2 whose follower is the other process.

Greedy tokens (prefill chunks, then decode steps batched over three sequences, one of them
dropped midway) are those of the same stages unsharded in one process and mlx-lm's own on
the whole model; the follower takes every step rank 0 takes and frees every sequence it
was told to; a sequence started from a prompt-cache entry (kept from a released sequence)
gets the tokens of its prompt run whole, every rank holding the entries rank 0's store
holds (pipeline/kvmirror.py), and a dropped sequence's step is left out on every rank,
without parting the ranks; the group lives
through an idle longer than its share deadline (rank 0's beats); and a group whose other
rank dies ends at once, naming it, never hanging.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from mlxceld.engine.sampling import greedy
from mlxceld.models import preset, write_fixture
from mlxceld.models.slicing import load_stage
from mlxceld.pipeline.compute import SeqState, run_group

from helpers.tensor_ranks import finish
from helpers.tensor_stages import (
    CHUNK,
    DECODE,
    DROP_AFTER,
    PROMPTS,
    scenario,
    start_stage_ranks,
)
from helpers.waiting import wait_for

LAYERS, SPLIT = 4, 2
RUN_S = 90.0  # both ranks' whole run: killed by pid past it (within pytest's timeout)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp-stage") / "llama"
    write_fixture(path, preset("tiny", family="llama", layers=LAYERS))
    return path


def unsharded(model: Path) -> dict[str, list[int]]:
    """The scenario over the two stages whole, in this process."""
    stages = {"A": load_stage(model, 0, SPLIT), "B": load_stage(model, SPLIT, LAYERS)}
    states: dict[tuple[str, str], SeqState] = {}

    def state(stage: str, seq: str) -> SeqState:
        if (stage, seq) not in states:
            states[stage, seq] = SeqState(stages[stage].make_cache(),
                                          greedy if stage == "B" else None)
        return states[stage, seq]

    return scenario(lambda g: run_group(stages["A"], g), lambda g: run_group(stages["B"], g),
                    state, lambda seq: None)


def mlx_lm_greedy(model: Path) -> dict[str, list[int]]:
    """mlx-lm's greedy tokens for each prompt alone, on the whole model."""
    m, _ = mlx_lm.load(str(model))[:2]
    out = {}
    for seq, prompt in PROMPTS.items():
        n = DROP_AFTER if seq == "c" else DECODE + 1
        out[seq] = [int(t) for t, _ in generate_step(mx.array(prompt), m, max_tokens=n)]
    return out


@pytest.mark.parametrize("tp", ["A", "B"])
def test_a_tensor_stage_generates_what_the_whole_stages_and_mlx_lm_do(
        llama: Path, tp: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    # idle 2 s past a share deadline of 1.5 s: rank 0's beats keep the follower
    procs = start_stage_ranks(llama, SPLIT, tp, out, share_deadline_s=1.5, idle_s=2.0)
    results = finish(procs, deadline_s=RUN_S)
    for rank, (code, text) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{text[-3000:]}"
    got = json.loads(out.read_text())
    whole = load_stage(llama, *((0, SPLIT) if tp == "A" else (SPLIT, LAYERS)))
    projections = sum(v.nbytes for name, v in tree_flatten(whole.model.parameters())
                      if "_proj" in name)  # each split in two; norms, embeddings, head whole
    assert got["nbytes"] == whole.nbytes - projections // 2
    want = unsharded(llama)
    assert got["tokens"] == want
    assert want == mlx_lm_greedy(llama)
    assert len(set(map(tuple, want.values()))) == 3  # three runs, not one repeated
    # "a"'s prompt kept at 6 tokens from a released sequence, its other 3 run from there
    assert got["reused"] == want["a"]
    # every group rank 0 ran, the follower ran: each prompt's chunks, then the decodes,
    # and the kept prompt's sequence and the one reusing it (its rest, then its decodes)
    chunks = -(-len(PROMPTS["a"]) // CHUNK) + len(PROMPTS) - 1
    follower = json.loads(Path(f"{out}.rank1").read_text())
    assert follower == {"steps": chunks + DECODE + 2 + DECODE, "sequences": 0,
                        "entries": 1}, follower  # the reusing one's prompt kept; "e" gone
    assert got["held"] == 0 and got["entries"] == 1
    assert got["left"] == [None]  # a dropped sequence's step: run on no rank (steps above)


@pytest.mark.parametrize("lost", [0, 1])
def test_a_tensor_stage_whose_other_rank_dies_ends_at_once(llama: Path, tmp_path: Path,
                                                           lost: int) -> None:
    """kill -9 of one rank while rank 0 idles between steps: the other ends within a few
    seconds (a share deadline of 60 s: not waited out), naming the rank lost."""
    out = tmp_path / "out.json"
    procs = start_stage_ranks(llama, SPLIT, "B", out, idle_s=120.0)
    try:
        wait_for(lambda: Path(f"{out}.idle").exists() or any(
            p.poll() is not None for p in procs), timeout=120.0, what="rank 0 to idle")
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        procs[lost].kill()
        other = procs[1 - lost]
        wait_for(lambda: other.poll() is not None, timeout=15.0,
                 what=f"rank {1 - lost} to fail once rank {lost} is gone")
    finally:
        results = finish(procs, deadline_s=10.0)
    code, text = results[1 - lost]
    assert code != 0
    if lost == 1:  # rank 0's watchdog: the follower's op link closed
        assert "tensor-parallel rank 1 (worker tp-1) is gone: its op link closed" in text, \
            text[-2000:]
    else:  # the follower's op link ended
        assert "EngineError: tensor-parallel rank 1 lost rank 0" in text, text[-2000:]
