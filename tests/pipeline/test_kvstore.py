"""A stage's prompt cache over real mlx-lm caches of a fixture slice: copies that never
change what they were copied from, trims by mlx-lm's rules (a window's wrapped cache
cannot be trimmed), a bound in bytes, an epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxceld.models import preset, write_fixture
from mlxceld.models.slicing import StageModel, load_stage
from mlxceld.pipeline.kvstore import (
    MAX_OWNERS,
    KvStore,
    StageCache,
    cache_bytes,
    cloned,
    held_tokens,
)
from mlxceld.pipeline.messages import Forget
from mlxceld.wire.transport_messages import Attach


def filled(stage: StageModel, tokens: list[int]) -> list[Any]:
    caches = stage.make_cache()
    stage.forward(mx.array([tokens], dtype=mx.int32), caches)
    return caches


def keys(caches: list[Any]) -> list[Any]:
    out = [c.state[0] for c in caches]
    mx.eval(out)
    return out


@pytest.fixture(scope="module")
def stage(split_fixture_dir: Path) -> StageModel:
    return load_stage(split_fixture_dir / "qwen3", 0, 2)


def test_a_copy_grows_without_touching_what_it_was_copied_from(stage: StageModel) -> None:
    prompt = list(range(1, 40))
    original = filled(stage, prompt)
    before = [k[..., :39, :] for k in keys(original)]
    copy = cloned(original, 30)
    assert held_tokens(copy) == 30 and held_tokens(original) == 39
    stage.forward(mx.array([[7] * 20], dtype=mx.int32), copy)  # writes at 30..49
    assert held_tokens(copy) == 50 and held_tokens(original) == 39
    for was, now in zip(before, keys(original), strict=True):
        assert mx.array_equal(was, now[..., :39, :])
    # And the copy holds what a cache filled with those tokens from scratch holds.
    fresh = filled(stage, prompt[:30] + [7] * 20)
    for a, b in zip(keys(copy), keys(fresh), strict=True):
        assert mx.allclose(a[..., :50, :], b[..., :50, :], atol=1e-5)


def test_put_trims_reuse_hits_and_misses_are_counted(stage: StageModel) -> None:
    store = KvStore(budget=1 << 30)
    stored = store.put("a", filled(stage, list(range(1, 21))), 15)
    assert stored.kept and stored.trimmable and stored.evicted == ()
    assert store.entries == 1 and store.nbytes > 0
    assert store.reuse("a", 10) is not None
    assert store.reuse("a", 16) is None  # it holds 15
    assert store.reuse("b", 3) is None
    assert (store.stats.hits, store.stats.misses, store.stats.tokens_reused) == (1, 2, 10)
    refused = store.put("c", filled(stage, [1, 2, 3]), 5)
    assert not refused.kept and refused.why == "holds 3 tokens, not 5"
    store.forget(["a", "zz"])
    assert store.entries == 0 and store.nbytes == 0


def test_past_its_bound_the_least_recently_used_go(stage: StageModel) -> None:
    one = cache_bytes(filled(stage, list(range(1, 11))))
    store = KvStore(budget=2 * one)
    for name in ("a", "b"):
        assert store.put(name, filled(stage, list(range(1, 11))), 10).kept
    assert store.reuse("a", 5) is not None  # a used: b is the oldest now
    stored = store.put("c", filled(stage, list(range(1, 11))), 10)
    assert stored.kept and stored.evicted == ("b",)
    assert store.reuse("b", 5) is None and store.reuse("a", 5) is not None
    too_big = KvStore(budget=one - 1)
    stored = too_big.put("x", filled(stage, list(range(1, 11))), 10)
    assert not stored.kept and too_big.entries == 0 and "over the prompt cache" in str(
        stored.why)
    assert KvStore(budget=0).put("y", filled(stage, [1, 2]), 2).kept is False


def test_another_routers_epoch_clears_it(stage: StageModel) -> None:
    store = KvStore(budget=1 << 30)
    store.attach("e1")
    store.put("a", filled(stage, [1, 2, 3]), 3)
    store.attach("e1")  # the same router again (a handover, a re-dial)
    assert store.entries == 1
    store.attach(None)  # a router that names no epoch changes nothing
    assert store.entries == 1
    store.attach("e2")
    assert store.entries == 0 and store.nbytes == 0 and store.epoch == "e2"


def test_two_routers_entries_are_kept_apart_by_their_identity(stage: StageModel) -> None:
    """Two routers of one pipeline name their entries with ids of their own: the same id
    is two entries, one's ``attach`` (a new epoch) and ``forget`` leave the other's."""
    cache = StageCache("stage-0", 1 << 30)
    a, b = "127.0.0.1:19000", "127.0.0.9:19000"
    assert cache.attached(a, Attach("m", "c", cache="ea")) == 1 << 30
    assert cache.attached(b, Attach("m", "c", cache="eb", cache_bytes=1 << 20)) == 1 << 20
    assert cache.put(a, "0", filled(stage, [1, 2, 3, 4]), 4).kept
    assert cache.put(b, "0", filled(stage, [9, 8]), 2).kept
    taken = cache.reuse(a, ("0", 4))
    assert taken is not None and held_tokens(taken[0]) == 4  # a's, not b's 2 tokens
    assert cache.reuse(b, ("0", 4)) is None  # b's "0" holds 2
    assert cache.reuse("127.0.0.7:1", ("0", 2)) is None  # a third router holds nothing
    cache.attached(a, Attach("m", "c", cache="ea2"))  # a restarted: its entries go
    assert cache.said(a).entries == 0 and cache.said(b).entries == 1
    assert cache.forget(a, Forget(("0",))).entries == 0 and cache.said(b).entries == 1
    nbytes, entries, budget, stats = cache.totals()
    assert entries == 1 and nbytes == cache.said(b).bytes > 0
    assert budget == (1 << 30) + (1 << 20) and stats.kept == 2 and stats.hits == 1


def test_a_capped_cache_keeps_nothing_whatever_a_router_names(stage: StageModel) -> None:
    """A stage capped at 0: the bound it answers ``attach`` with is 0, and nothing is
    kept, so nothing is ever reused."""
    cache = StageCache("stage-0", 0, cap=0)
    a = "127.0.0.1:19000"
    assert cache.attached(a, Attach("m", "c", cache="ea", cache_bytes=1 << 30)) == 0
    assert cache.attached(a, Attach("m", "c", cache="ea")) == 0
    assert not cache.put(a, "0", filled(stage, [1, 2, 3, 4]), 4).kept
    assert cache.reuse(a, ("0", 4)) is None
    assert StageCache("s", 0, cap=1 << 20).attached(
        a, Attach("m", "c", cache_bytes=1 << 30)) == 1 << 20  # a cap bounds what is named


def test_a_stage_keeps_at_most_max_owners_routers_stores(stage: StageModel) -> None:
    cache = StageCache("stage-0", 1 << 30)
    for n in range(MAX_OWNERS + 2):
        cache.attached(f"127.0.0.{n + 1}:1", Attach("m", "c", cache=f"e{n}"))
    assert len(cache.stores) == MAX_OWNERS
    assert "127.0.0.1:1" not in cache.stores and "127.0.0.2:1" not in cache.stores
    assert f"127.0.0.{MAX_OWNERS + 2}:1" in cache.stores


def test_a_window_that_wrapped_cannot_be_trimmed(tmp_path: Path) -> None:
    path = tmp_path / "gemma"
    write_fixture(path, preset("tiny", family="gemma3_text", layers=2, sliding_window=16))
    stage = load_stage(path, 0, 2)
    store = KvStore(budget=1 << 30)
    short = store.put("short", filled(stage, list(range(1, 13))), 10)
    assert short.kept and short.trimmable
    assert store.reuse("short", 4) is not None
    wrapped = filled(stage, list(range(1, 41)))  # 40 tokens through a 16-token window
    assert not store.put("w", wrapped, 30).kept  # 40 -> 30 needs a trim it cannot do
    whole = store.put("w", filled(stage, list(range(1, 41))), 40)
    assert whole.kept and not whole.trimmable
    assert store.reuse("w", 40) is not None and store.reuse("w", 39) is None
