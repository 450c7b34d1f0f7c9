"""The router's index of what its pipeline's stages hold in their prompt caches.

Every stage keeps the KV of its own layers (``kvstore.py``); only the router sees every
request's tokens, so it decides, and all stages follow the same decisions: what is kept
(a finished sequence's tokens, ``release`` with ``keep``; a prompt once prefilled,
``prepare`` with ``keep_prompt``), what a new request starts from (``prepare`` with
``reuse``), and what is dropped (``forget``). An entry is named in a ``reuse`` only once
every stage said it kept it; a stage that evicted an entry for room, or could not keep
it, says so, and the entry is dropped everywhere (``forget``). A stage that no longer
holds what a ``reuse`` names answers so, and the request is prepared afresh: never a
sequence that starts from different prefixes on different stages.

Which entry a prompt starts from follows mlx-lm's ``LRUPromptCache``: the longest
shared prefix, whether the entry is a prefix of the prompt (its tokens as they are) or
goes on past where the two part (then each stage trims its copy, which a window's
wrapped cache cannot: ``trimmable``); at least the prompt's last token is always run, to
sample from. An entry whose every stage can trim it makes its own prefixes redundant:
they are dropped once it is kept. At most ``max_entries`` are held; past that the least
recently used goes.

Sans-IO: it decides, ``engine.py`` sends; every method returns the entry ids that every
stage is to forget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

MAX_ENTRIES: Final = 64


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kept: set[int] = field(default_factory=set)  # the stage ranks that hold it
    trimmable: bool = True  # every stage that kept it can trim it


@dataclass(frozen=True)
class Reuse:
    """Start from ``entry``'s first ``tokens`` tokens."""

    entry: str
    tokens: int


@dataclass
class IndexStats:
    lookups: int = 0
    hits: int = 0  # requests that started from a kept prefix
    tokens_reused: int = 0
    lost: int = 0  # a stage no longer held what was named: prepared afresh
    kept: int = 0  # entries every stage holds, since the start
    dropped: int = 0  # entries dropped (evicted, not kept, replaced, forgotten)


class PrefixIndex:
    def __init__(self, ranks: Iterable[int], max_entries: int = MAX_ENTRIES) -> None:
        self._ranks = frozenset(ranks)
        self._max = max_entries
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._next = 0
        self.stats = IndexStats()

    @property
    def entries(self) -> int:
        """Entries every stage holds."""
        return sum(1 for e in self._entries.values() if e.kept == self._ranks)

    @property
    def pending(self) -> int:
        """Entries named in a keep that not every stage has said it holds yet."""
        return len(self._entries) - self.entries

    def lookup(self, prompt: Sequence[int]) -> Reuse | None:
        """The kept entry the prompt shares the longest prefix with, and how much of it
        to start from; None when none shares a token (or the prompt is one token)."""
        self.stats.lookups += 1
        want = tuple(prompt)
        best: tuple[int, bool, str] | None = None  # (tokens, needs no trim, entry)
        for entry_id, entry in self._entries.items():
            if entry.kept != self._ranks:
                continue
            shared = common_prefix(entry.tokens, want)
            n = min(shared, len(want) - 1)
            untrimmed = n == len(entry.tokens)
            if n < 1 or not (untrimmed or entry.trimmable):
                continue
            if best is None or (n, untrimmed) > best[:2]:
                best = (n, untrimmed, entry_id)
        if best is None:
            return None
        self._entries.move_to_end(best[2])
        return Reuse(best[2], best[0])

    def started(self, reuse: Reuse) -> None:
        """Every stage started a sequence from ``reuse``."""
        self.stats.hits += 1
        self.stats.tokens_reused += reuse.tokens

    def lost(self, reuse: Reuse) -> list[str]:
        """A stage no longer held ``reuse``'s entry: it goes everywhere."""
        self.stats.lost += 1
        return self._drop([reuse.entry])

    def add(self, tokens: Sequence[int]) -> tuple[str, list[str]]:
        """A new entry for ``tokens``, to be kept by every stage (named in a ``keep`` or
        ``keep_prompt``); and the entries to forget for room."""
        self._next += 1
        entry_id = f"p{self._next}"
        self._entries[entry_id] = _Entry(tuple(tokens))
        overflow = [e for e in self._entries if e != entry_id][:max(
            0, len(self._entries) - self._max)]
        return entry_id, self._drop(overflow)

    def kept(self, rank: int, entry_id: str | None, kept: bool, trimmable: bool,
             evicted: Iterable[str]) -> list[str]:
        """Stage ``rank`` answered a keep (``entry_id``: whether it ``kept`` it, whether it
        can trim it) or a forget, having ``evicted`` entries for room."""
        gone = list(evicted)
        entry = None if entry_id is None else self._entries.get(entry_id)
        if entry_id is not None and entry is None:
            # Dropped here meanwhile (or never ours): the stage must not keep it.
            return self._drop(gone) + ([entry_id] if kept else [])
        if entry is not None and entry_id is not None:
            if not kept:
                gone.append(entry_id)
            else:
                entry.kept.add(rank)
                entry.trimmable = entry.trimmable and trimmable
                if entry.kept == self._ranks:
                    self.stats.kept += 1
                    gone += self._redundant(entry_id, entry)
        return self._drop(gone)

    def _redundant(self, entry_id: str, entry: _Entry) -> list[str]:
        """What a newly kept entry makes redundant: the entries that are a prefix of one
        that every stage holds and can trim (itself, when one holds more of it), and one
        of the same tokens."""
        gone = []
        for other_id, other in self._entries.items():
            if other_id == entry_id:
                continue
            if other.tokens == entry.tokens:  # the same prefix twice: the older goes
                gone.append(other_id)
                continue
            shorter, longer = (other, entry) if len(other.tokens) < len(entry.tokens) \
                else (entry, other)
            if len(shorter.tokens) == len(longer.tokens) or not longer.trimmable \
                    or longer.kept != self._ranks \
                    or longer.tokens[:len(shorter.tokens)] != shorter.tokens:
                continue
            gone.append(other_id if shorter is other else entry_id)
        return gone

    def abandon(self, entry_id: str) -> list[str]:
        """An entry some stage may never keep (its sequence ended first): it goes."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.kept == self._ranks:
            return []
        return self._drop([entry_id])

    def clear(self) -> list[str]:
        """Every entry goes (a stage re-attached: it may hold nothing, or what we no longer
        know of)."""
        return self._drop(list(self._entries))

    def _drop(self, entry_ids: Iterable[str]) -> list[str]:
        dropped = []
        for entry_id in dict.fromkeys(entry_ids):
            if self._entries.pop(entry_id, None) is not None:
                self.stats.dropped += 1
                dropped.append(entry_id)
        return dropped


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start (slices compared in C, a
    binary search over their length)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low
