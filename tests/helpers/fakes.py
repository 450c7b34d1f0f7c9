"""Fakes of our own seams: an Engine that follows a script, a codec of one token per byte."""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_lm.tool_parsers import json_tools

from mlxceld.api import ChatFeatures, ChatMessage, ChatTemplateError, StreamDecoder
from mlxceld.engine import EngineError, GenerationRequest, TokenOutput

EOS = 256


class ByteDecoder:
    def __init__(self, incremental: bool = True) -> None:
        self.incremental = incremental
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        assert 0 <= token < 256, f"the decoder was given token {token}"
        return self._utf8.decode(bytes([token]))

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)


# What ToolByteCodec's model writes: json_tools calls and Qwen's thinking markers.
TOOL_FEATURES = ChatFeatures(tool_call=("<tool_call>", "</tool_call>"),
                             think=("<think>", "</think>"),
                             parse_tool_call=json_tools.parse_tool_call)


class ByteCodec:
    """One token per UTF-8 byte; 256 is end-of-sequence. Its chat template is
    ``<role>content`` per message, then ``<assistant>``; it knows no "tool" role and
    no tools."""

    eos_token_ids = frozenset({EOS})
    vocab_size = EOS + 1
    features = ChatFeatures()

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < EOS else b""

    def encode_prompt(self, text: str) -> list[int]:
        return list(text.encode())

    def encode_chat(self, messages: list[ChatMessage], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        if any(m.role == "tool" for m in messages):
            raise ChatTemplateError("the chat template knows no role 'tool'")
        return self.encode_prompt("".join(f"<{m.role}>{m.content}" for m in messages)
                                  + "<assistant>")

    def opens_thinking(self, prompt: Sequence[int]) -> bool:
        return False

    def decoder(self) -> StreamDecoder:
        return ByteDecoder()


class ToolByteCodec(ByteCodec):
    """A ``ByteCodec`` whose template has tools (``<tools>`` and their JSON first),
    tool calls and results, and opens ``<think>`` at the answer unless
    ``enable_thinking`` is false. ``templated``: what each call was given."""

    features = TOOL_FEATURES

    def __init__(self) -> None:
        self.templated: list[tuple[list[ChatMessage], Any, dict[str, Any]]] = []

    def encode_chat(self, messages: list[ChatMessage], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        kwargs = dict(template_kwargs or {})
        self.templated.append((messages, tools, kwargs))
        text = f"<tools>{json.dumps(list(tools))}" if tools else ""
        for m in messages:
            calls = "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>"
                            for c in m.template_dict().get("tool_calls", []))
            text += f"<{m.role}>{m.content}{calls}"
        think = "<think>" if kwargs.get("enable_thinking", True) else "<think></think>"
        return self.encode_prompt(text + "<assistant>" + think)

    def opens_thinking(self, prompt: Sequence[int]) -> bool:
        text = bytes(prompt).decode()
        return text.rfind("<think>") > text.rfind("</think>")


@dataclass
class FakeEngine:
    """Generates ``reply`` then EOS, or (no reply) the prompt over and over; stops at
    ``max_tokens`` with "length". It can stall or fail after some tokens, and it
    records every request, every sequence closed early, and the most run at once."""

    model_id: str = "fake-model"
    context_length: int = 256
    max_batch: int = 4
    reply: bytes | None = None
    eos_after: int | None = None
    stall_after: int | None = None
    fail_after: int | None = None
    unmarked_eos: bool = False  # send EOS without finish_reason "stop"
    delay_s: float = 0.0
    requests: list[GenerationRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    active: int = 0
    peak: int = 0
    closed: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def script(self, request: GenerationRequest) -> list[TokenOutput]:
        limit = request.params.max_tokens
        prompt = list(request.prompt_tokens)
        body = list(self.reply) if self.reply is not None else \
            [prompt[i % len(prompt)] for i in range(limit)]
        if self.eos_after is not None:
            body = body[: self.eos_after]
        outputs = [self.output(t, request) for t in body[:limit]]
        if len(outputs) == limit:
            outputs[-1] = replace(outputs[-1], finish_reason="length")
        else:
            outputs.append(replace(self.output(EOS, request),
                                   finish_reason=None if self.unmarked_eos else "stop"))
        return outputs

    @staticmethod
    def output(token: int, request: GenerationRequest) -> TokenOutput:
        """With logprobs asked: the token's is -token/1000, its alternatives the token
        itself and those after it, each 0.5 less likely than the one before."""
        n = request.params.logprobs
        if n is None:
            return TokenOutput(token)
        lp = -token / 1000
        return TokenOutput(token, None, lp,
                           tuple(((token + k) % 256, lp - k / 2) for k in range(n)))

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        assert self.active < self.max_batch, "more sequences than max_batch were admitted"
        self.requests.append(request)
        self.active += 1
        self.peak = max(self.peak, self.active)
        ended = False
        try:
            for n, output in enumerate(self.script(request)):
                if self.stall_after is not None and n >= self.stall_after:
                    await self.release.wait()
                if self.fail_after is not None and n >= self.fail_after:
                    ended = True
                    raise EngineError("the fake engine broke down")
                await asyncio.sleep(self.delay_s)
                if output.finish_reason is not None:
                    ended = True
                    self.completed.append(request.request_id)
                yield output
            if not ended:  # an unmarked EOS: the script ran out
                ended = True
                self.completed.append(request.request_id)
        finally:
            self.active -= 1
            if not ended:
                self.cancelled.append(request.request_id)

    def active_sequences(self) -> int:
        return self.active

    async def aclose(self) -> None:
        self.closed = True
