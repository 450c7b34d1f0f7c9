"""How a prompt's new part is cut into prefill chunks (``engine.chunks``)."""

from __future__ import annotations

from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.engine import MAX_CHUNK, MIN_CHUNK, chunks
from mlxceld.roles.options import KVQuant


def test_about_six_chunks_a_stage_within_the_bounds() -> None:
    assert chunks(352, 2) == [32] * 11  # a chat turn: at the floor
    assert chunks(2018, 2) == [184] * 5 + [183] * 6  # a long prompt: eleven of ~184
    assert chunks(10_000, 2) == [250] * 40  # at most MAX_CHUNK, evened out
    assert chunks(40, 2) == [40]  # less than two chunks' floor: one
    assert chunks(65, 3) == [33, 32]
    assert chunks(1, 3) == [1]
    assert chunks(0, 2) == []
    for n in (1, 63, 64, 65, 500, 777, 4096):
        for stages in (2, 3, 8):
            sizes = chunks(n, stages)
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1  # evened out
            assert max(sizes) <= max(MAX_CHUNK, n) and (len(sizes) == 1
                                                        or min(sizes) >= MIN_CHUNK)
            assert len(sizes) == 1 or max(sizes) <= MAX_CHUNK


def test_one_stage_takes_the_largest_chunks_and_a_late_quantized_cache_mlx_lms_own() -> None:
    assert chunks(1200, 1) == [400, 400, 400]  # one stage: mlx-lm's 512 at most
    assert chunks(1200, 2, KVQuant(8, 64, 100)) == [512, 512, 175, 1]
    assert chunks(1200, 2, KVQuant(8, 64, 0)) == chunks(1200, 2)
    assert p.PREFILL_CHUNK == 512
