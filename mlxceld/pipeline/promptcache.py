"""The pipeline engine's side of its stages' prompt cache.

The index of what every stage keeps is ``prefixes.py`` (sans-IO); the stages' stores are
``kvstore.py``. This is what the engine holds between them: the index (None when the
cache is off: a bound of 0), this engine's epoch (``attach``: stages drop what an
earlier engine had them keep), each stage's holdings as it last said (``cache``), and the
``forget`` of every entry the index lets go, sent to every stage through ``forget`` (the
engine's, unanswered). A stage attached again may have restarted, holding nothing, or
hold what was dropped meanwhile: the whole index goes, and every stage forgets.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mlxceld.pipeline.messages import Cache
from mlxceld.pipeline.prefixes import PrefixIndex, Reuse
from mlxceld.types import PipelineCacheStats


class PromptCache:
    """The engine's prompt cache over its stages (``ranks``)."""

    def __init__(self, ranks: Iterable[int], budget_bytes: int | None,
                 forget: Callable[[list[str]], None]) -> None:
        """``budget_bytes``: each stage's bound (0: no prompt cache; None: each stage's
        default); ``forget``: have every stage drop these entries."""
        self.attach: tuple[str | None, int | None] = (uuid.uuid4().hex[:16], budget_bytes)
        self._prefixes = None if budget_bytes == 0 else PrefixIndex(ranks)
        self._forget = forget
        self._held: dict[int, tuple[int, int]] = {}  # rank -> its cache's (bytes, entries)
        self._attached_once: set[int] = set()

    @property
    def on(self) -> bool:
        return self._prefixes is not None

    def lookup(self, prompt: Sequence[int]) -> Reuse | None:
        """The longest prefix of ``prompt`` every stage keeps, if any."""
        return None if self._prefixes is None else self._prefixes.lookup(prompt)

    def started(self, reuse: Reuse) -> None:
        assert self._prefixes is not None
        self._prefixes.started(reuse)

    def lost(self, reuse: Reuse) -> None:
        """A stage no longer held ``reuse``'s entry: it is forgotten everywhere."""
        assert self._prefixes is not None
        self._forget(self._prefixes.lost(reuse))

    def added(self, tokens: Sequence[int]) -> str:
        """A new entry for ``tokens`` (what it pushed out is forgotten)."""
        assert self._prefixes is not None
        entry, gone = self._prefixes.add(tokens)
        self._forget(gone)
        return entry

    def said(self, rank: int, cache: Cache) -> None:
        """A stage's ``cache``: what it kept or not, what it evicted, what it holds."""
        self._held[rank] = (cache.bytes, cache.entries)
        if self._prefixes is None:
            return
        self._forget(self._prefixes.kept(rank, cache.entry, cache.kept, cache.trimmable,
                                         list(cache.evicted)))

    def attached(self, rank: int) -> None:
        """A stage attached. Again: it may have restarted (holding nothing) or hold what
        we may have dropped meanwhile; the whole index goes, and every stage forgets."""
        if rank in self._attached_once and self._prefixes is not None:
            self._forget(self._prefixes.clear())
        self._attached_once.add(rank)

    def of_stage(self, rank: int, budget: int | None) -> dict[str, Any] | None:
        """A stage's prompt cache as it last said (bytes, entries, its bound)."""
        if self._prefixes is None:
            return None
        size, entries = self._held.get(rank, (0, 0))
        return {"bytes": size, "entries": entries, "budget": budget}

    def stats(self) -> PipelineCacheStats:
        """The prompt cache, for the router's stats and ``/metrics`` (all zeros when it is
        off): the requests that started from a kept prefix (``hits``) or from nothing
        (``misses``), the prompt tokens not prefilled again, the entries every stage holds
        and the bytes they hold all told, as each last said; and ``lost``: a prefix named
        that a stage no longer held (prefilled whole), ``pending``: entries not every stage
        has said it holds yet."""
        if self._prefixes is None:
            return {"hits": 0, "misses": 0, "tokens_reused": 0, "entries": 0, "bytes": 0,
                    "lost": 0, "pending": 0}
        stats = self._prefixes.stats
        return {"hits": stats.hits, "misses": stats.lookups - stats.hits,
                "tokens_reused": stats.tokens_reused, "entries": self._prefixes.entries,
                "bytes": sum(b for b, _ in self._held.values()), "lost": stats.lost,
                "pending": self._prefixes.pending}
