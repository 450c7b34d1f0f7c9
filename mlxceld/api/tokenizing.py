"""Tokenizing prompts off the event loop, and giving the memory back afterwards.

A prompt of a few MB takes seconds to tokenize (about 1 s a MB on one core): on the
event loop, ``/health`` and every other request would wait that long. Prompts are
tokenized in threads: below ``LARGE_PROMPT_BYTES`` in asyncio's default ones, at or
above it one at a time in a thread of their own (three 4 MB prompts at once took
2.3 GB where one takes 0.9 GB). Before that, ``requests.check_prompt_bytes`` has
refused what cannot fit the context at all.

The tokenizer's working set for a 4 MB prompt is about 600 MB, which glibc's malloc
keeps after it is freed: the router would stay at its peak. After a large prompt,
``release_memory`` asks ``malloc_trim(0)`` to hand the free pages back (about 650 MB
to 160 MB measured, the rest going with the token list). Without glibc (macOS, whose
allocator returns free pages itself) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from mlxceld.api.codec import ChatMessage, TextCodec

T = TypeVar("T")

LARGE_PROMPT_BYTES: Final = 1 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def release_memory() -> None:
    """Return the allocator's free pages to the OS, where the allocator lets us ask."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class PromptTokenizer:
    """The codec's ``encode_prompt`` and ``encode_chat``, awaited in a thread."""

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._large = ThreadPoolExecutor(1, thread_name_prefix="large-prompt")

    async def prompt(self, text: str, size: int) -> list[int]:
        """``text`` (``size`` UTF-8 bytes) as token ids."""
        return await self._run(self._codec.encode_prompt, text, size)

    async def chat(self, messages: list[ChatMessage], size: int, *,
                   tools: Sequence[Mapping[str, Any]] | None = None,
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The chat template applied to ``messages`` (``size`` bytes of content and tools)
        with ``tools`` and ``template_kwargs``, as ids; raises the codec's
        ``ChatTemplateError``."""
        encode = functools.partial(self._codec.encode_chat, tools=tools,
                                   template_kwargs=template_kwargs)
        return await self._run(encode, messages, size)

    async def _run(self, encode: Callable[[T], list[int]], arg: T, size: int) -> list[int]:
        if size < LARGE_PROMPT_BYTES:
            return await asyncio.to_thread(encode, arg)

        def large() -> list[int]:
            try:
                return encode(arg)
            finally:
                release_memory()

        return await asyncio.get_running_loop().run_in_executor(self._large, large)
