"""A stage's grouping of queued steps, and batched steps equal to one-by-one steps."""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlxceld.engine.sampling import greedy
from mlxceld.models.slicing import StageModel, load_stage
from mlxceld.pipeline.compute import MAX_BATCH, SeqState, Step, next_groups, plan, run_group
from mlxceld.wire import Tensor

from helpers.models import FAMILIES


def tokens(ids: list[int]) -> Tensor:
    return Tensor("tokens", "i32", (1, len(ids)), memoryview(struct.pack(f"<{len(ids)}i", *ids)))


def step(seq: str, n: int, i: int = 0) -> Step:
    return Step(seq, SeqState([], None), i, True, tokens(list(range(1, n + 1))))


def ids(groups: list[list[Step]]) -> list[list[tuple[str, int]]]:
    return [[(s.seq_id, s.step) for s in g] for g in groups]


def test_plan_batches_first_decode_steps_and_keeps_each_sequences_order() -> None:
    queued = [step("a", 1, 0), step("b", 5, 0), step("c", 1, 0), step("a", 1, 1),
              step("b", 1, 1), step("d", 1, 0)]
    assert ids(plan(queued)) == [
        [("a", 0), ("c", 0), ("d", 0)],  # first-in-line one-token steps
        [("b", 0)], [("a", 1)], [("b", 1)],  # the rest, in arrival order
    ]
    assert ids(plan([step("x", 3)])) == [[("x", 0)]]
    many = plan([step(f"s{i}", 1) for i in range(MAX_BATCH + 2)])
    assert [len(g) for g in many] == [MAX_BATCH, 1, 1]


def test_decoding_sequences_wait_for_one_prefill_chunk_not_a_whole_prompt() -> None:
    # A long prompt's four chunks are queued, and two sequences decode.
    queued = [step("long", 64, i) for i in range(4)] + [step("a", 1), step("b", 1)]
    groups, left = next_groups(queued)
    assert ids(groups) == [[("a", 0), ("b", 0)], [("long", 0)]]
    # Their next steps arrive while the first chunk runs: they go before the second.
    groups, left = next_groups([*left, step("a", 1, 1), step("b", 1, 1)])
    assert ids(groups) == [[("a", 1), ("b", 1)], [("long", 1)]]
    groups, left = next_groups(left)  # nothing decoding now: the next chunk alone
    assert ids(groups) == [[("long", 2)]] and ids([left]) == [[("long", 3)]]
    assert next_groups([]) == ([], [])


def run_groups(stages: list[StageModel], inputs: dict[int, list[int]],
               states: list[list[SeqState]], groups: list[list[int]],
               overlap: bool = False, sample: bool = True) -> dict[int, int]:
    """Run sequences ``groups`` at a time through every stage, each group as one step (a
    batch where it has several); the sampled token of each (``None`` unless ``sample``)."""
    result: dict[int, int] = {}
    for members in groups:
        blobs = [tokens(inputs[i]) for i in members]
        for k, st in enumerate(stages):
            outs = run_group(st, [Step(str(i), states[i][k], 0, sample, blobs[j])
                                  for j, i in enumerate(members)], overlap=overlap)
            if not st.last:
                blobs = [Tensor(name, dtype, shape, data) for name, dtype, shape, data in outs]
        for j, i in enumerate(members):
            result[i] = outs[j] and outs[j].token
    return result


def run_through(stages: list[StageModel], inputs: list[list[int]],
                states: list[list[SeqState]], groups: list[list[int]],
                overlap: bool = False) -> list[int]:
    """Run sequences ``groups`` at a time through every stage; the sampled token of each."""
    result = run_groups(stages, dict(enumerate(inputs)), states, groups, overlap)
    return [result[i] for i in range(len(inputs))]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("splits", [[(0, 2), (2, 4)], [(0, 4)]])
def test_batched_decode_equals_one_by_one(split_fixture_dir: Path,
                                          splits: list[tuple[int, int]],
                                          overlap: bool) -> None:
    path = split_fixture_dir / "qwen3"
    stages = [load_stage(path, a, b) for a, b in splits]
    prompts = [[1, 5, 9, 200, 31], [7, 7], [300, 2, 4, 8, 16, 32, 64]]
    singly = [[i] for i in range(len(prompts))]

    def new_states() -> list[list[SeqState]]:
        return [[SeqState(st.make_cache(), greedy if st.last else None) for st in stages]
                for _ in prompts]

    alone, together = new_states(), new_states()
    # Prompts of different lengths prefill one by one; then decode one by one for
    # `alone`, as one batch (caches merged and split each step) for `together`.
    a = run_through(stages, prompts, alone, singly)
    b = run_through(stages, prompts, together, singly)
    for _ in range(6):
        a = run_through(stages, [[t] for t in a], alone, singly)
        b = run_through(stages, [[t] for t in b], together, [list(range(len(prompts)))],
                        overlap)
        assert a == b


# Prompts of different lengths; those over CHUNK prefill in chunks, as PREFILL_CHUNK splits
# a long prompt (engine.py), while the others decode.
LENGTHS = (3, 11, 26, 47, 90)
CHUNK = 32
DECODE = 24


def mlx_lm_alone(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """mlx-lm's own greedy tokens for each prompt alone (``generate_step`` on the whole
    model, prefilling in the same chunks)."""
    model, _ = load(str(path))
    return [[int(t) for t, _ in generate_step(mx.array(pr), model, max_tokens=n,
                                              sampler=greedy, prefill_step_size=CHUNK)]
            for pr in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_sequences_under_load_get_what_mlx_lm_gives_each_alone(
        bf16_split_fixture_dir: Path, family: str) -> None:
    """Sequence i arrives at step i: its prefill (in chunks when long) runs while the ones
    before it decode, in batches whose members change from step to step, as a loaded stage
    groups them (compute.plan); every sequence still gets mlx-lm's tokens for it alone."""
    path = bf16_split_fixture_dir / family
    stages = [load_stage(path, 0, 2), load_stage(path, 2, 4)]
    prompts = [[(i * 37 + n * 11) % 500 + 1 for i in range(n)] for n in LENGTHS]
    states = [[SeqState(st.make_cache(), greedy if st.last else None) for st in stages]
              for _ in prompts]
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for t in range(len(prompts) + DECODE):
        decoding = [i for i in out if 0 < len(out[i]) < DECODE]
        if t < len(prompts):  # a new arrival: its chunks run alone, between decode steps
            chunks = [prompts[t][a:a + CHUNK] for a in range(0, len(prompts[t]), CHUNK)]
            for k, chunk in enumerate(chunks):
                got = run_groups(stages, {t: chunk}, states, [[t]],
                                 sample=k == len(chunks) - 1)
            out[t].append(got[t])
        # This step's batches: two, their members rotating from step to step.
        turn = decoding[t % len(decoding):] + decoding[:t % len(decoding)] if decoding else []
        half = (len(turn) + 1) // 2
        groups = [g for g in (turn[:half], turn[half:]) if g]
        got = run_groups(stages, {i: [out[i][-1]] for i in decoding}, states, groups)
        for i in decoding:
            out[i].append(got[i])
    want = mlx_lm_alone(path, prompts, DECODE)
    differ = {LENGTHS[i]: (out[i], want[i]) for i in range(len(prompts)) if out[i] != want[i]}
    assert not differ, (f"{len(differ)} of {len(prompts)} sequences (by prompt length) differ "
                        f"from mlx-lm's alone: {differ}")


def test_a_batched_bf16_step_gives_each_sequence_the_bits_it_gets_alone(
        bf16_split_fixture_dir: Path) -> None:
    """What compute.py's docstring says of the CPU backend: merged, left-padded caches round
    nothing differently; the hidden states a batched decode step sends on are, byte for
    byte, those of each sequence's step alone."""
    stage = load_stage(bf16_split_fixture_dir / "llama", 0, 2)
    prompts = [[(i * 37 + n * 11) % 500 + 1 for i in range(n)] for n in (5, 18, 41)]
    alone = [SeqState(stage.make_cache(), None) for _ in prompts]
    together = [SeqState(stage.make_cache(), None) for _ in prompts]
    for states in (alone, together):
        for i, pr in enumerate(prompts):
            run_group(stage, [Step(str(i), states[i], 0, False, tokens(pr))])
    for t in range(1, 4):
        steps = [[Step(str(i), states[i], t, False, tokens([7 + i + t]))
                  for i in range(len(prompts))] for states in (alone, together)]
        one_by_one = [run_group(stage, [s])[0] for s in steps[0]]
        batched = run_group(stage, steps[1])
        assert [bytes(blob[3]) for blob in batched] == [bytes(blob[3]) for blob in one_by_one]
