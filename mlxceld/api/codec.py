"""The text seam: turning requests into token ids, and generated ids back into text.

The router asks a ``TextCodec`` for prompt ids (chat template applied) and for
one ``StreamDecoder`` per sequence. ``MlxTextCodec`` is the real one, over
mlx-lm's ``TokenizerWrapper``: its chat template and its streaming detokenizer
(BPE, SentencePiece or naive, as mlx-lm chose when it loaded the tokenizer).
Tests give the router a simpler codec of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import jinja2

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat, its content parts already joined into one string."""

    role: Role
    content: str


class ChatTemplateError(Exception):
    """The chat template refused the messages (a role it does not know, an order it
    forbids). The client's to fix: the router answers 400."""


class StreamDecoder(Protocol):
    """Token ids in, text out, one sequence at a time.

    ``incremental``: whether ``add`` costs about the same for every token (mlx-lm's BPE
    and SentencePiece detokenizers: 2 to 4 us), so that the router calls it on its event
    loop; a hop to a thread costs the loop ten times that. When False (mlx-lm's naive
    detokenizer decodes the whole line so far at every token), the router calls
    ``add`` and ``finish`` in a thread."""

    incremental: bool

    def add(self, token: int) -> str:
        """Take one token; return the text that became final with it, possibly ""
        (a multi-byte UTF-8 character is never split across two returns)."""
        ...

    def finish(self) -> str:
        """The sequence ended: return whatever text was still held back."""
        ...


class TextCodec(Protocol):
    eos_token_ids: frozenset[int]
    vocab_size: int  # the tokenizer's token ids are 0 .. vocab_size - 1

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character, maybe), as a
        token's ``bytes`` in logprobs show them."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids, with the tokenizer's usual special tokens (BOS)."""
        ...

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        """The chat template applied with ``add_generation_prompt=True``, as ids.
        Raises ``ChatTemplateError`` when the template refuses the messages."""
        ...

    def decoder(self) -> StreamDecoder: ...


class MlxTextCodec:
    """A ``TextCodec`` over an ``mlx_lm.tokenizer_utils.TokenizerWrapper``.

    A tokenizer without a chat template gets a plain one: a ``role: content``
    line per message, then ``assistant:``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self.vocab_size = len(tokenizer)
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token: int) -> bytes:
        """From the vocabulary mlx-lm's detokenizer reads: byte-level BPE's characters
        mapped back to bytes, SentencePiece's pieces (``<0xNN>`` a byte, ``▁`` a
        space), else the token decoded alone."""
        if token not in self._bytes:
            self._bytes[token] = _token_bytes(self._tokenizer, token)
        return self._bytes[token]

    def encode_prompt(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text)]

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        if not self._tokenizer.has_chat_template:
            lines = "".join(f"{m.role}: {m.content}\n" for m in messages)
            return self.encode_prompt(lines + "assistant:")
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        try:
            ids = self._tokenizer.apply_chat_template(dicts, add_generation_prompt=True,
                                                      tokenize=True)
        except (jinja2.TemplateError, ValueError) as exc:
            raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") \
                from exc
        return [int(t) for t in ids]

    def decoder(self) -> StreamDecoder:
        return _MlxDecoder(self._tokenizer.detokenizer)


class _MlxDecoder:
    """mlx-lm's streaming detokenizers hold back incomplete UTF-8 and hand out
    ``last_segment``: the text that became final since the last look."""

    def __init__(self, detokenizer: Any) -> None:
        from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

        self._detokenizer = detokenizer
        self.incremental = not isinstance(detokenizer, NaiveStreamingDetokenizer)

    def add(self, token: int) -> str:
        self._detokenizer.add_token(token)
        return str(self._detokenizer.last_segment)

    def finish(self) -> str:
        self._detokenizer.finalize()
        return str(self._detokenizer.last_segment)


def _token_bytes(tokenizer: Any, token: int) -> bytes:
    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        SPMStreamingDetokenizer,
        _byte_decoder,
    )

    detokenizer = tokenizer.detokenizer  # a fresh copy: only its token map is read
    if isinstance(detokenizer, SPMStreamingDetokenizer) and token < len(detokenizer.tokenmap):
        return bytes(detokenizer.tokenmap[token]).replace(SPMStreamingDetokenizer._sep, b" ")
    if isinstance(detokenizer, BPEStreamingDetokenizer) and token < len(detokenizer.tokenmap):
        decoder = _byte_decoder()
        return b"".join(bytes([decoder[c]]) if c in decoder else c.encode()
                        for c in str(detokenizer.tokenmap[token]))
    return str(tokenizer.decode([token])).encode()
