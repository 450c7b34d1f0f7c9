"""The text seam: turning requests into token ids, and generated ids back into text.

The router asks a ``TextCodec`` for prompt ids (chat template applied) and for
one ``StreamDecoder`` per sequence. ``MlxTextCodec`` is the real one, over
mlx-lm's ``TokenizerWrapper``: its chat template and its streaming detokenizer
(BPE, SentencePiece or naive, as mlx-lm chose when it loaded the tokenizer).
Tests give the router a simpler codec of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import jinja2

ChatRole = Literal["system", "user", "assistant", "tool"]
# A generation prompt that opens a reasoning block does so in its last few tokens.
THINK_TAIL_TOKENS = 64


@dataclass(frozen=True)
class CalledTool:
    """A tool call of an earlier assistant message, as the client sent it back.
    ``arguments``: a JSON object's text (OpenAI's wire form); the template gets the object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat, its content parts already joined into one string;
    an assistant's ``tool_calls``, a tool result's ``tool_call_id``, the sender's ``name``,
    an earlier answer's ``reasoning``."""

    role: ChatRole
    content: str
    tool_calls: tuple[CalledTool, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None  # the participant's name, for templates that show it
    reasoning: str | None = None  # an earlier answer's reasoning_content (assistant)

    @property
    def size(self) -> int:
        """The UTF-8 bytes of what it puts in the prompt: content, reasoning, name and its
        calls (``requests.check_prompt_bytes`` weighs a chat by them before tokenizing)."""
        texts = [self.content, self.reasoning or "", self.name or "",
                 *(c.name + c.arguments for c in self.tool_calls)]
        return sum(len(t.encode()) for t in texts)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's and mlx-lm's convention: a call's
        arguments as an object, not OpenAI's JSON string; ``name`` and
        ``reasoning_content`` under those keys, which templates that know them read)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ChatFeatures:
    """What the model's chat template and tokenizer offer beyond plain chat.

    ``tool_call``: the markers around a tool call in the output (``<tool_call>``,
    ``</tool_call>``) and ``parse_tool_call`` the model's parser of the text between them
    (mlx-lm's ``tool_parser``: text and the tools in, ``{"name", "arguments"}`` or a list of
    them out; raises ValueError on text it cannot parse); None: no tool calling.
    ``think``: the markers around reasoning (``<think>``, ``</think>``); None: none.
    ``marker_ids``: the markers that are one token each, with its id (a grammar names the
    token, which llguidance counts as special, rather than the text)."""

    tool_call: tuple[str, str] | None = None
    think: tuple[str, str] | None = None
    parse_tool_call: ToolParser | None = field(default=None, compare=False)
    marker_ids: tuple[tuple[str, int], ...] = ()


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
    features: ChatFeatures

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character, maybe), as a
        token's ``bytes`` in logprobs show them."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids, with the tokenizer's usual special tokens (BOS)."""
        ...

    def encode_chat(self, messages: list[ChatMessage], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The chat template applied with ``add_generation_prompt=True``, as ids, with
        ``tools`` (OpenAI's tool objects; None: none) and the client's ``template_kwargs``
        (``enable_thinking``). Raises ``ChatTemplateError`` when the template refuses them."""
        ...

    def opens_thinking(self, prompt: Sequence[int]) -> bool:
        """Whether the prompt ends inside a reasoning block (the template opened one that
        the model is to close): the answer starts as reasoning."""
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
        has_template = bool(tokenizer.has_chat_template)
        tools = has_template and bool(tokenizer.has_tool_calling) and \
            tokenizer.tool_parser is not None
        tool_call = (tokenizer.tool_call_start, tokenizer.tool_call_end) if tools else None
        think = (tokenizer.think_start, tokenizer.think_end) \
            if has_template and tokenizer.has_thinking else None
        ids = {m: tokenizer.encode(m, add_special_tokens=False)
               for m in (*(tool_call or ()), *(think or ()))}
        self.features = ChatFeatures(
            tool_call=tool_call, think=think,
            parse_tool_call=tokenizer.tool_parser if tools else None,
            marker_ids=tuple((m, int(t[0])) for m, t in ids.items() if len(t) == 1))
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

    def encode_chat(self, messages: list[ChatMessage], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        if not self._tokenizer.has_chat_template:
            lines = "".join(f"{m.role}: {m.content}\n" for m in messages)
            return self.encode_prompt(lines + "assistant:")
        dicts = [m.template_dict() for m in messages]
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools:
            extra["tools"] = [dict(t) for t in tools]
        try:
            ids = self._tokenizer.apply_chat_template(dicts, add_generation_prompt=True,
                                                      tokenize=True, **extra)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") \
                from exc
        return [int(t) for t in ids]

    def opens_thinking(self, prompt: Sequence[int]) -> bool:
        if self.features.think is None:
            return False
        ids = list(prompt[-THINK_TAIL_TOKENS:])
        start = self._tokenizer.rfind_think_start(ids)  # -1: not found
        return bool(start >= 0 and self._tokenizer.rfind_think_end(ids) < start)

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
