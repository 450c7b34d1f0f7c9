"""The engine's prompt (prefix) cache: mlx-lm's ``LRUPromptCache``, and what it saved.

KV caches kept by their tokens (a finished sequence's prompt and generated tokens, a
prefill node's prompt once prefilled), so that a new prompt sharing a prefix with one (a
chat's earlier turns, a repeated system prompt) prefills only the rest. At most
``ENTRIES`` caches and ``max_bytes`` bytes (``[serve] prompt_cache_bytes``; 0: none
kept), the least recently used dropped first; mlx-lm trims a longer cache to the shared
prefix where its kind allows (``can_trim_prompt_cache``).

Every lookup counts: a hit reuses at least one token, a miss none; ``stats()`` is what
``/metrics`` and ``mlxctl status`` show (``types.PromptCacheStats``). Used on the engine's
step thread only; ``stats()`` may be read from any thread (a snapshot of plain ints).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlxceld.types import PromptCacheStats

ENTRIES: Final = 16
DEFAULT_BYTES: Final = 2 << 30  # [serve] prompt_cache_bytes unset
MODEL_KEY: Final = "model"  # one model per engine: mlx-lm's cache needs a key, any will do


class PromptCache:
    """KV caches by their tokens, bounded in entries and bytes (the module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"a prompt cache of {max_bytes} bytes: it must be 0 or more")
        self.max_bytes = max_bytes
        self._lru = LRUPromptCache(ENTRIES, max_bytes)
        self._hits = self._misses = self._reused = 0

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, tokens: Sequence[int]) -> tuple[Any, list[int]]:
        """A copy of the KV cache of the longest prefix of ``tokens`` held (None: none),
        and the tokens still to prefill: never none of them (an exact hit gives back its
        last token to compute, its cache trimmed by one, so that there are logits to
        sample from)."""
        cache, rest = self._nearest(list(tokens))
        reused = len(tokens) - len(rest)
        if reused:
            self._hits += 1
            self._reused += reused
        else:
            self._misses += 1
        return cache, rest

    def _nearest(self, tokens: list[int]) -> tuple[Any, list[int]]:
        if not tokens or not len(self._lru):
            return None, tokens
        cache, rest = self._lru.fetch_nearest_cache(MODEL_KEY, tokens)
        if cache is not None and not rest:
            if not can_trim_prompt_cache(cache):
                return None, tokens
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return (cache, list(rest)) if cache is not None else (None, tokens)

    def keep(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """``cache`` (the KV of ``tokens``, one entry per layer) kept for reuse; the
        caller gives it up (keep a copy where it goes on being used)."""
        if tokens and self.max_bytes > 0:
            self._lru.insert_cache(MODEL_KEY, list(tokens), cache)

    def stats(self) -> PromptCacheStats:
        return {"hits": self._hits, "misses": self._misses, "tokens_reused": self._reused,
                "entries": len(self._lru), "bytes": int(self._lru.nbytes)}
