"""A stage's prompt cache: the KV of its layers for token prefixes its router named.

The router decides what every stage keeps and reuses (``prefixes.py``); a stage only
holds what it was told to, under the router's entry ids, and answers truthfully when it
no longer holds something. An entry is the caches of this stage's layers (one mlx-lm
cache per layer, of the kind the family makes: ``KVCache``, ``RotatingKVCache`` for a
window's layers, a quantized one with ``kv_bits``) and how many tokens they hold.

- ``put``: a released sequence's caches (``release`` with ``keep``), or a running
  one's after its prompt was prefilled (``prepare`` with ``keep_prompt``, a copy made by
  ``cloned``), trimmed to the tokens the router named. An entry that cannot be trimmed
  there (a window's cache that has wrapped: mlx-lm's ``can_trim_prompt_cache``) is not
  kept, and the router hears so.
- ``reuse``: a new sequence starts from an entry's caches trimmed to ``n`` tokens
  (``cloned``: its arrays shared with the entry, copied by mlx on the first write, so the
  entry itself never changes).
- The store is bounded in bytes (``budget``): past it, the entries least recently put or
  reused go first, and ``put`` reports which, so that the router drops them everywhere.
- ``attach`` with another engine's epoch clears it: a new plan, a live switch, a
  restarted router name other entries. Each router has a store of its own
  (``StageCache``): another router's ``attach`` clears nothing of it.

``StageCache`` is the store as the stage protocol speaks of it (``protocol.py``):
``attach``'s epoch and bound, ``prepare``'s ``reuse``, ``forget``, and the ``cache``
answers that tell the router what was kept, evicted and is held. A tensor-parallel
stage's rank 0 gives it a ``Journal``: each change to its entries (an entry put, entries
dropped, a store cleared) told in the order it is made, so that the other ranks, whose
caches hold their shards of the same tokens, hold the same entries (``tensor_stage.py``,
``kvmirror.py``).

Runs on the stage's event loop, between compute steps (``put`` of a released sequence)
or with what a step returned (``cloned`` runs on the compute side): nothing here computes.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from mlxceld.pipeline.messages import Cache, Forget, Span
from mlxceld.wire.transport_messages import Attach

log = logging.getLogger(__name__)


@dataclass
class Entry:
    caches: list[Any]  # one mlx-lm cache per own layer
    tokens: int
    nbytes: int


@dataclass(frozen=True)
class Stored:
    """What ``put`` did: kept or not (and why not), and the entries evicted for room."""

    kept: bool
    evicted: tuple[str, ...] = ()
    why: str | None = None
    trimmable: bool = False  # the entry kept can be trimmed to a shorter prefix


@dataclass
class StoreStats:
    hits: int = 0  # sequences that started from an entry
    misses: int = 0  # reuses asked of an entry this stage no longer held (or could not trim)
    tokens_reused: int = 0
    kept: int = 0
    evicted: int = 0


@dataclass
class KvStore:
    budget: int  # bytes; 0 keeps nothing
    epoch: str | None = None
    stats: StoreStats = field(default_factory=StoreStats)
    _entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    _nbytes: int = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def entries(self) -> int:
        return len(self._entries)

    def attach(self, epoch: str | None) -> bool:
        """A router attached naming its cache ``epoch``: another one's entries go (True:
        the store was cleared)."""
        if epoch is None or epoch == self.epoch:
            return False
        if self._entries:
            log.info("prompt cache: %d entries (%d bytes) of an earlier router dropped",
                     len(self._entries), self._nbytes)
        self.clear()
        self.epoch = epoch
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._nbytes = 0

    def reuse(self, entry_id: str, n: int) -> list[Any] | None:
        """The entry's caches if they can give the first ``n`` tokens (``cloned`` makes
        the sequence's own copy); None when this stage no longer holds them, or holds
        more that it cannot trim away."""
        entry = self._entries.get(entry_id)
        if entry is None or n > entry.tokens or (n < entry.tokens
                                                 and not trimmable(entry.caches)):
            self.stats.misses += 1
            return None
        self._entries.move_to_end(entry_id)
        self.stats.hits += 1
        self.stats.tokens_reused += n
        return entry.caches

    def put(self, entry_id: str, caches: list[Any], n: int) -> Stored:
        """Keep ``caches`` (owned by the store from now on) as ``entry_id``, trimmed to
        ``n`` tokens; evict the least recently used entries past the budget."""
        self.forget([entry_id])
        held = held_tokens(caches)
        if held < n:
            return Stored(False, why=f"holds {held} tokens, not {n}")
        if held > n and not trim(caches, held - n):
            return Stored(False, why="its caches cannot be trimmed (a window that wrapped)")
        size = cache_bytes(caches)
        if size > self.budget:
            return Stored(False, why=f"{size} bytes, over the prompt cache's {self.budget}")
        self._entries[entry_id] = Entry(caches, n, size)
        self._nbytes += size
        self.stats.kept += 1
        evicted = []
        while self._nbytes > self.budget:
            old, entry = self._entries.popitem(last=False)
            self._nbytes -= entry.nbytes
            evicted.append(old)
        self.stats.evicted += len(evicted)
        return Stored(entry_id in self._entries, tuple(e for e in evicted if e != entry_id),
                      trimmable=trimmable(caches))

    def forget(self, entry_ids: Iterable[str]) -> list[str]:
        """Drop those entries; the ids of those it held."""
        dropped = []
        for entry_id in entry_ids:
            entry = self._entries.pop(entry_id, None)
            if entry is not None:
                self._nbytes -= entry.nbytes
                dropped.append(entry_id)
        return dropped


MAX_OWNERS = 8  # routers whose entries one stage keeps at once (past it: the stalest go)

# What a put entry's caches are, for a journal: the sequence whose caches they are, and
# whether they are a copy taken after its prompt's prefill (``keep_prompt``) rather than
# a released sequence's own (``release`` with ``keep``).
Source = tuple[str, bool]


class Journal(Protocol):
    """Told each change to a ``StageCache``'s entries, in the order it is made (a
    tensor-parallel stage's rank 0: ``tensor_stage.StageLeader``)."""

    def put(self, owner: str, entry: str, n: int, source: Source, kept: bool) -> None:
        """``source``'s caches were put as ``owner``'s ``entry`` of ``n`` tokens (after
        that id's old entry was dropped), or not kept (``kept`` False: let go)."""

    def dropped(self, owner: str, entries: list[str]) -> None:
        """Those of ``owner``'s entries were dropped (forgotten, or evicted for room)."""

    def cleared(self, owner: str | None) -> None:
        """``owner``'s store was emptied (None: every store)."""


class StageCache:
    """A stage's ``KvStore`` per router, and what the stage protocol says of it.

    Every router of a pipeline (its coordinator and any other, ``protocol.py``) names its
    own entries with ids of its own (``prefixes.py``), and its own epoch: the stores are
    kept apart by the router's identity (the handshake's, the sequence's owner), so that
    two routers' ids never meet and one router's ``attach`` never clears another's. Each
    store is bounded by what its router named (or the stage's default); at most
    ``MAX_OWNERS`` routers' stores are kept, the one attached longest ago dropped first.
    """

    def __init__(self, node_id: str, default_bytes: int, *, cap: int | None = None,
                 journal: Journal | None = None) -> None:
        """``default_bytes``: the bound unless the router names one in ``attach``; ``cap``:
        the most a router may name; ``journal``: told each change to the entries."""
        self.stores: OrderedDict[str, KvStore] = OrderedDict()  # owner -> its entries
        self._node_id = node_id
        self._default = default_bytes
        self._cap = cap
        self._journal = journal

    def store(self, owner: str) -> KvStore:
        """``owner``'s store (a new, empty one under the default bound if it has none)."""
        store = self.stores.get(owner)
        if store is None:
            store = self.stores[owner] = KvStore(self._default)
            while len(self.stores) > MAX_OWNERS:
                gone, old = self.stores.popitem(last=False)
                log.info("prompt cache: router %s's %d entries dropped (%d routers kept)",
                         gone, old.entries, MAX_OWNERS)
                if self._journal is not None:
                    self._journal.cleared(gone)
        return store

    def attached(self, owner: str, attach: Attach) -> int:
        """An ``attach`` from ``owner``: its epoch and bound; the bound in force, for
        ``attached``."""
        store = self.store(owner)
        self.stores.move_to_end(owner)
        if store.attach(attach.cache) and self._journal is not None:
            self._journal.cleared(owner)
        store.budget = self._default if attach.cache_bytes is None else attach.cache_bytes
        if self._cap is not None:
            store.budget = min(store.budget, self._cap)
        return store.budget

    def reuse(self, owner: str, reuse: Span | None) -> tuple[list[Any], int] | None:
        """A ``prepare``'s ``reuse``: the entry's caches and how many tokens to start from,
        or None when it names none, or one this stage cannot give ``owner``."""
        if reuse is None or owner not in self.stores:
            return None
        source = self.stores[owner].reuse(*reuse)
        return None if source is None else (source, reuse[1])

    def forget(self, owner: str, forget: Forget) -> Cache:
        """A ``forget`` from ``owner``: drop those of its entries; the ``cache`` answer."""
        dropped = self.store(owner).forget(list(forget.entries))
        if dropped and self._journal is not None:
            self._journal.dropped(owner, dropped)
        return self.said(owner)

    def put(self, owner: str, entry: str, caches: list[Any], n: int,
            source: Source | None = None) -> Cache:
        """Keep ``caches`` as ``owner``'s ``entry`` (``KvStore.put``); the ``cache``
        answer. ``source``: what they are, for the journal (one is needed with it)."""
        store = self.store(owner)
        replaced = store.forget([entry])
        stored = store.put(entry, caches, n)
        if stored.why is not None:
            log.info("stage %s did not keep prompt-cache entry %s: %s", self._node_id, entry,
                     stored.why)
        if self._journal is not None:
            if source is None:
                raise ValueError(f"stage {self._node_id}: entry {entry} put with no source "
                                 "for the journal")
            if replaced:
                self._journal.dropped(owner, replaced)
            self._journal.put(owner, entry, n, source, stored.kept)
            if stored.evicted:
                self._journal.dropped(owner, list(stored.evicted))
        return replace(self.said(owner), evicted=tuple(stored.evicted), entry=entry,
                       kept=stored.kept, trimmable=stored.trimmable, why=stored.why)

    def said(self, owner: str) -> Cache:
        """A ``cache`` message: what ``owner``'s store holds now."""
        store = self.store(owner)
        return Cache(store.nbytes, store.entries)

    def clear(self) -> None:
        self.stores.clear()
        if self._journal is not None:
            self._journal.cleared(None)

    def totals(self) -> tuple[int, int, int, StoreStats]:
        """Bytes and entries held, the bounds and the counts, over every router's store."""
        stats = StoreStats()
        for s in self.stores.values():
            for name in ("hits", "misses", "tokens_reused", "kept", "evicted"):
                setattr(stats, name, getattr(stats, name) + getattr(s.stats, name))
        stores = self.stores.values()
        budget = sum(s.budget for s in stores) if self.stores else self._default
        return (sum(s.nbytes for s in stores), sum(s.entries for s in stores), budget, stats)


def held_tokens(caches: list[Any]) -> int:
    """How many tokens a sequence's caches hold (every layer holds as many)."""
    return int(getattr(caches[0], "offset", 0)) if caches else 0


def trimmable(caches: list[Any]) -> bool:
    from mlx_lm.models.cache import can_trim_prompt_cache

    return bool(can_trim_prompt_cache(caches))


def trim(caches: list[Any], n: int) -> bool:
    """Drop the last ``n`` tokens of every layer's cache, if mlx-lm can."""
    from mlx_lm.models.cache import trim_prompt_cache

    if n == 0:
        return True
    if not trimmable(caches):
        return False
    trim_prompt_cache(caches, n)
    return True


def cloned(caches: list[Any], n: int) -> list[Any]:
    """A copy of ``caches`` holding their first ``n`` tokens, whose arrays are new views
    of the same data: writing into the copy leaves the original as it was (mlx copies a
    buffer that another array still refers to before it writes), so nothing is copied
    until the copy grows. The caller checked that ``caches`` can be trimmed to ``n``."""
    out = [_clone(c) for c in caches]
    held = held_tokens(out)
    if held > n and not trim(out, held - n):
        raise ValueError(f"a cache of {held} tokens cannot be trimmed to {n}")
    return out


def _clone(value: Any) -> Any:
    """``value`` with every mlx array in it (a cache's, a tuple's: a quantized cache's
    keys are three arrays; a cache list's caches) a new view of the same data."""
    import mlx.core as mx

    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, tuple | list):
        return type(value)(_clone(v) for v in value)
    if callable(getattr(value, "is_trimmable", None)):  # an mlx-lm cache
        twin = copy.copy(value)
        for name, attr in vars(value).items():
            setattr(twin, name, _clone(attr))
        return twin
    return value


def cache_bytes(caches: list[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)
