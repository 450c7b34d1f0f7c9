"""A tensor-parallel stage's prompt cache on its other ranks: rank 0's entries, change by
change.

Rank 0 alone decides what its stage keeps, reuses, evicts and forgets, under its bound
(its store's bytes are its shard's: about what each rank holds). Its ``StageCache`` tells
each change to its journal (``kvstore.Journal``: ``tensor_stage.StageLeader``), which
puts it in the op log the followers apply in order, between the sequences opened and
dropped and the steps. A follower's ``MirroredCache`` holds exactly the entries rank 0's
store holds, each the follower's shard of the same tokens: no bound of its own, no
eviction of its own (rank 0's evictions come as drops).

An entry is put from the caches rank 0 put it from, taken on each follower at the same
point of the sequence's steps: a released sequence's own caches (``release`` with
``keep``), parked when rank 0 drops the sequence, and the copy of a sequence's caches
made right after the step that finished its prompt (``keep_prompt``), parked when that
step ran. Each parked set is taken by the one ``put`` that rank 0 makes of it, kept or
let go. A sequence that starts from an entry takes it when rank 0 opens the sequence
(``reuse``): its copy is then made at its first step, on every rank alike
(``compute.forward_group``).

A change a follower cannot apply (an entry it does not hold, caches it never parked, an
entry it cannot keep as rank 0 did) means the ranks' caches parted, a bug: ``EngineError``
naming the stage, the entry and the sequence, and the follower's group ends as for any
broken rank (``tensor_stage.py``). It never runs on without the entry.

Runs on the follower's thread; ``entries`` and ``nbytes`` are read from another (the
worker's stats).
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, Final

from mlxceld.engine.base import EngineError
from mlxceld.pipeline.kvstore import KvStore, Source

UNBOUNDED: Final = sys.maxsize  # a follower's stores evict nothing of their own


class MirroredCache:
    """The entries of rank 0's store, on one follower (the module docstring)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.stores: dict[str, KvStore] = {}  # by router, as rank 0's
        self._parked: dict[Source, deque[list[Any]]] = {}
        self.entries = 0  # held now, over every router's store
        self.nbytes = 0

    def park(self, source: Source, caches: list[Any]) -> None:
        """``source``'s caches, for the ``put`` rank 0 makes of them next."""
        self._parked.setdefault(source, deque()).append(caches)

    @property
    def parked(self) -> int:
        return sum(len(q) for q in self._parked.values())

    def put(self, owner: str, entry: str, n: int, source: Source, kept: bool) -> None:
        """Rank 0 put ``source``'s caches as ``owner``'s ``entry`` of ``n`` tokens (or let
        them go: ``kept`` False)."""
        seq_id = source[0]
        queue = self._parked.get(source)
        if not queue:
            raise self._parted(f"rank 0 put {self._what(source)} as prompt-cache entry "
                               f"{entry} of router {owner}, and this rank holds no such "
                               "caches")
        caches = queue.popleft()
        if not queue:
            del self._parked[source]
        if not kept:
            return
        store = self.stores.setdefault(owner, KvStore(UNBOUNDED))
        if store.forget([entry]):
            raise self._parted(f"rank 0 put prompt-cache entry {entry} of router {owner} "
                               f"(sequence {seq_id}) without dropping the one this rank "
                               "held under that id")
        stored = store.put(entry, caches, n)
        if not stored.kept:
            raise self._parted(f"rank 0 kept {self._what(source)} as prompt-cache entry "
                               f"{entry} of router {owner} ({n} tokens) and this rank "
                               f"could not: {stored.why}")
        self._count()

    def dropped(self, owner: str, entries: list[str]) -> None:
        """Rank 0 dropped those of ``owner``'s entries (forgotten or evicted)."""
        store = self.stores.get(owner)
        held = [] if store is None else store.forget(entries)
        missing = [e for e in entries if e not in held]
        self._count()
        if missing:
            raise self._parted(f"rank 0 dropped prompt-cache entries {missing} of router "
                               f"{owner}, which this rank does not hold")

    def cleared(self, owner: str | None) -> None:
        """Rank 0 emptied ``owner``'s store (None: every store)."""
        if owner is None:
            self.stores.clear()
        else:
            self.stores.pop(owner, None)
        self._count()

    def reuse(self, owner: str, entry: str, n: int, seq_id: str) -> tuple[list[Any], int]:
        """``SeqState.reuse`` for sequence ``seq_id``, which rank 0 opened from ``owner``'s
        ``entry``'s first ``n`` tokens."""
        store = self.stores.get(owner)
        caches = None if store is None else store.reuse(entry, n)
        if caches is None:
            raise self._parted(f"rank 0 opened sequence {seq_id} from prompt-cache entry "
                               f"{entry} of router {owner} ({n} tokens), which this rank "
                               "does not hold")
        return caches, n

    def _count(self) -> None:
        self.entries = sum(s.entries for s in self.stores.values())
        self.nbytes = sum(s.nbytes for s in self.stores.values())

    @staticmethod
    def _what(source: Source) -> str:
        seq_id, prefilled = source
        return (f"sequence {seq_id}'s caches after its prompt" if prefilled
                else f"released sequence {seq_id}'s caches")

    def _parted(self, what: str) -> EngineError:
        return EngineError(f"tensor stage {self.node_id}: {what}: the ranks' prompt caches "
                           "parted (a bug); the group must restart")
