"""A tensor-parallel stage's prompt cache on a follower (pipeline/kvmirror.py), over real
mlx-lm caches of a fixture slice: rank 0's store told to its journal change by change
(puts, evictions under a small bound, forgets, another epoch's attach, a router's store
dropped past MAX_OWNERS) and applied to a ``MirroredCache`` leaves it holding the same
entries, the same tokens; and a follower told of an entry it does not hold fails at once,
naming the stage, the entry and the sequence (never running on without the cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxceld.engine.base import EngineError
from mlxceld.engine.tensor import Mirror
from mlxceld.models.slicing import StageModel, load_stage
from mlxceld.pipeline.kvmirror import MirroredCache
from mlxceld.pipeline.kvstore import MAX_OWNERS, StageCache, cloned, held_tokens
from mlxceld.pipeline.messages import Forget
from mlxceld.pipeline.tensor_stage import StageFollower
from mlxceld.wire.transport_messages import Attach

A = "127.0.0.1:19000"


class Recorder:
    """A ``kvstore.Journal`` that writes down each change, as ``StageLeader`` logs it."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, tuple[Any, ...]]] = []

    def put(self, *args: Any) -> None:
        self.changes.append(("put", args))

    def dropped(self, *args: Any) -> None:
        self.changes.append(("dropped", args))

    def cleared(self, *args: Any) -> None:
        self.changes.append(("cleared", args))


@pytest.fixture(scope="module")
def stage(split_fixture_dir: Path) -> StageModel:
    return load_stage(split_fixture_dir / "qwen3", 0, 2)


def filled(stage: StageModel, tokens: list[int]) -> list[Any]:
    caches = stage.make_cache()
    stage.forward(mx.array([tokens], dtype=mx.int32), caches)
    return caches


def held(store: Any) -> dict[str, int]:
    """An owner's entries and their tokens."""
    return {e: entry.tokens for e, entry in store._entries.items()}


def test_a_mirror_applying_the_journal_holds_what_rank_0_holds(stage: StageModel) -> None:
    journal, mirror = Recorder(), MirroredCache("stage-1")
    cache = StageCache("stage-1", 1 << 30, journal=journal)

    def put(owner: str, entry: str, tokens: list[int], n: int, prefilled: bool) -> None:
        # each rank's own caches of the same tokens (here: the same slice), parked where
        # rank 0 took its own: its drop (released) or its step (prefilled)
        mine, theirs = filled(stage, tokens), filled(stage, tokens)
        if prefilled:
            mine, theirs = cloned(mine, held_tokens(mine)), cloned(theirs, len(tokens))
        mirror.park((entry + "-seq", prefilled), theirs)
        cache.put(owner, entry, mine, n, (entry + "-seq", prefilled))
        replay()

    def replay() -> None:
        for name, args in journal.changes:
            getattr(mirror, name)(*args)
        journal.changes.clear()

    cache.attached(A, Attach("m", "c", cache="e1"))
    put(A, "x", list(range(1, 30)), 20, False)  # trimmed to 20 on every rank
    put(A, "y", list(range(5, 25)), 20, True)
    size = cache.said(A).bytes // 2
    assert mirror.entries == 2 and mirror.nbytes == cache.said(A).bytes
    cache.store(A).budget = 2 * size + 1  # room for two such entries: the third evicts
    put(A, "z", list(range(9, 29)), 20, False)
    assert held(cache.store(A)) == held(mirror.stores[A]) == {"y": 20, "z": 20}
    assert cache.store(A).stats.evicted == 1
    put(A, "y", list(range(2, 40)), 38, True)  # an id put again: the old one dropped first
    assert held(mirror.stores[A]) == held(cache.store(A)) == {"z": 20, "y": 38}
    put(A, "w", list(range(3, 9)), 9, False)  # not kept (6 tokens): let go everywhere
    assert mirror.parked == 0 and "w" not in held(mirror.stores[A])
    caches, n = mirror.reuse(A, "y", 30, "q")  # a reuse trims as rank 0's does
    assert n == 30 and held_tokens(caches) == 38
    cache.forget(A, Forget(("y", "z", "never")))
    replay()
    assert held(mirror.stores[A]) == {}
    for i in range(MAX_OWNERS + 1):  # the first router's store goes past MAX_OWNERS
        owner = f"127.0.0.{i + 2}:1"
        cache.attached(owner, Attach("m", "c", cache="e"))
        put(owner, "v", list(range(1, 8)), 7, False)
    assert set(mirror.stores) == set(cache.stores) and A not in cache.stores
    cache.attached("127.0.0.3:1", Attach("m", "c", cache="another"))  # a new epoch: cleared
    put("127.0.0.4:1", "u", list(range(1, 8)), 7, False)
    replay()
    assert {o: held(s) for o, s in mirror.stores.items() if s.entries} \
        == {o: held(s) for o, s in cache.stores.items() if s.entries}
    cache.clear()
    replay()
    assert mirror.entries == 0 and mirror.stores == {}


def test_a_follower_told_to_reuse_an_entry_it_does_not_hold_fails_naming_it(
        stage: StageModel) -> None:
    follower = StageFollower(stage, Mirror(mx.distributed.init()))
    follower._apply(("setup", stage.start, stage.end, stage.num_layers, "stage-1"))
    with pytest.raises(EngineError, match=r"tensor stage stage-1: rank 0 opened sequence "
                       r"q7 from prompt-cache entry e9 of router 127\.0\.0\.1:19000 "
                       r"\(4 tokens\), which this rank does not hold"):
        follower._apply(("open", "q7", None, (A, "e9", 4)))
    assert follower.sequences == 0
    with pytest.raises(EngineError, match=r"stage-1: rank 0 put released sequence s2's "
                       "caches as prompt-cache entry e3 of router .*no such caches"):
        follower._apply(("put", A, "e3", 4, ("s2", False), True))
    with pytest.raises(EngineError, match=r"rank 0 dropped prompt-cache entries \['e4'\] "
                       r"of router 127\.0\.0\.1:19000, which this rank does not hold"):
        follower._apply(("forget", A, ("e4",)))
