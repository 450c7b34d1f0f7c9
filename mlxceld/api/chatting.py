"""What every chat-shaped endpoint shares: a parsed ``ChatRequest`` in, a sequence ready
for the ``Sequencer`` out.

Every endpoint reads its body through ``Chats.read`` (bounded, and its unknown fields
refused or, under ``[serve] unknown_fields = "warn"``, ignored and named: ``ignoring.py``).
``/v1/chat/completions`` parses OpenAI's chat body into a ``ChatRequest``; other
endpoints that hold a conversation (OpenAI's Responses API, Anthropic's Messages API)
translate their own bodies into the same ``ChatRequest`` and come here for the rest:
the tools checked against what the model offers, the prompt measured and rendered
through the chat template (in a thread; with the reasoning effort asked,
``reasoning.py``), the constraint of ``response_format`` moved past an opened reasoning
block, a forced ``tool_choice``'s grammar, the sampling
parameters once the prompt's length is known, and how the answer is read (its
reasoning and tool calls apart from its content: ``ChatReply``). Each endpoint then
writes the ``Sequencer``'s events in its own format.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from mlxceld.api.codec import ChatTemplateError, TextCodec
from mlxceld.api.edge.draining import Draining
from mlxceld.api.errors import ApiError, invalid
from mlxceld.api.generation import Sequencer
from mlxceld.api.ignoring import IgnoredFields
from mlxceld.api.reasoning import template_kwargs
from mlxceld.api.requests import (
    ChatRequest,
    Options,
    check_constraint,
    check_prompt_bytes,
    read_body,
    sampling_params,
)
from mlxceld.api.tokenizing import PromptTokenizer
from mlxceld.api.tools.calls import parse_calls
from mlxceld.api.tools.grammar import after_thinking, forced_constraint, json_object_calls
from mlxceld.api.tools.replies import ChatReply, ReplySplitter
from mlxceld.engine import Constraint, Engine, GenerationRequest, SamplingParams
from mlxceld.models.generation import SamplingDefaults

T = TypeVar("T")


@dataclass(frozen=True)
class PreparedChat:
    """A chat ready to generate: hand ``request``, ``stops`` and ``reply`` to
    ``Sequencer.generate_text``."""

    request: GenerationRequest
    stops: tuple[str, ...]
    reply: ChatReply | None  # None: the model has neither reasoning nor tools offered
    options: Options  # as parsed (stream, include_usage, logprobs)
    thinking: bool  # the prompt opened the model's reasoning: the answer starts inside it


@dataclass
class Chats:
    """The router's engine, codec and sequencer, as the chat-shaped endpoints use them."""

    engine: Engine
    codec: TextCodec
    sequencer: Sequencer
    tokenizer: PromptTokenizer
    model_id: str
    max_tokens: int | None  # the operator's ``[serve] max_tokens`` (None: the context)
    max_body_bytes: int
    is_ready: Callable[[], bool]
    draining: Draining
    names: tuple[str, ...] = ()  # every name a request may call the model by, id first
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # of sampling
    ignoring: IgnoredFields = field(default_factory=IgnoredFields)  # [serve] unknown_fields

    async def read(self, request: Request, parse: Callable[[bytes, list[str] | None], T]) -> T:
        """The request's body (at most ``max_body_bytes``), parsed by ``parse``, which is
        given where unknown fields go (None: it refuses them; ``ignoring.py``); those it
        ignored are logged and named in the answer's header. Every endpoint reads so."""
        ignored = self.ignoring.collector()
        parsed = parse(await read_body(request, self.max_body_bytes), ignored)
        self.ignoring.note(request.scope, ignored)
        return parsed

    def check_ready(self) -> float:
        """Refuse (503) while the model loads or a node it needs drains; else the
        request's arrival (``time.monotonic()``), for its time to first token."""
        arrived = time.monotonic()
        if not self.is_ready():
            raise ApiError(503, "the model is still loading; retry shortly", "server_error",
                           code="not_ready", headers={"Retry-After": "1"})
        self.draining.check()
        return arrived

    def params(self, prompt: list[int], options: Options, prompt_param: str,
               constraint: Constraint | None = None) -> SamplingParams:
        """The sampling parameters for ``prompt`` (its length bounds ``max_tokens``), with
        a forced tool choice's ``constraint`` (only one grammar at a time)."""
        params = sampling_params(options, prompt_tokens=len(prompt),
                                 context_length=self.engine.context_length,
                                 max_tokens_bound=self.max_tokens,
                                 prompt_param=prompt_param, vocab_size=self.codec.vocab_size)
        if constraint is not None:
            if params.constraint is not None:  # response_format's: one grammar at a time
                raise invalid("a forced 'tool_choice' and a 'response_format' cannot both "
                              "constrain the answer; drop one of them", "tool_choice")
            if params.min_tokens or params.ignore_eos:  # the grammar may end the answer
                raise invalid("a forced 'tool_choice' cannot be honoured with 'min_tokens' "
                              "or 'ignore_eos'; drop one of them", "tool_choice")
            params = dataclasses.replace(params, constraint=constraint)
        return params

    async def prepare(self, parsed: ChatRequest, request_id: str) -> PreparedChat:
        """``parsed`` rendered, tokenized and checked; ``request_id`` names the sequence
        (and its tool calls' ids). Raises ``ApiError`` (400) naming what is wrong."""
        tools = _template_tools(parsed, self.codec, self.model_id)
        size = sum(m.size for m in parsed.messages) + \
            sum(len(json.dumps(t)) for t in tools)
        check_prompt_bytes(size, context_length=self.engine.context_length,
                           prompt_param="messages")
        options = parsed.options
        await check_constraint(options)
        try:
            prompt = await self.tokenizer.chat(list(parsed.messages), size,
                                               tools=tools or None,
                                               template_kwargs=template_kwargs(
                                                   dict(parsed.template_kwargs),
                                                   parsed.reasoning_effort))
        except ChatTemplateError as exc:
            raise invalid(str(exc), "messages") from None
        thinking = self.codec.opens_thinking(prompt)
        if thinking and options.constraint is not None:  # the JSON is content, not reasoning
            options = dataclasses.replace(
                options, constraint=after_thinking(options.constraint, self.codec.features))
        use = parsed.tools
        forced = None
        if tools and use is not None and use.forced:
            forced = await forced_constraint(use.offered, self.codec.features,
                                             parallel=use.parallel, close_thinking=thinking)
        params = self.params(prompt, options, "messages", forced)
        return PreparedChat(GenerationRequest(request_id, prompt, params), options.stop,
                            _reply(parsed, self.codec, tools, thinking, request_id),
                            parsed.options, thinking)


def _template_tools(parsed: ChatRequest, codec: TextCodec, model_id: str) -> list[Any]:
    """The tools the chat template is given, checked against what the model offers."""
    use = parsed.tools
    if use is None or not use.offered:
        return []
    features = codec.features
    if features.tool_call is None:
        raise invalid(f"the model {model_id!r} does not support tool calling: its chat "
                      "template and tokenizer have no tool-call format; leave out 'tools' "
                      "(or set 'tool_choice' to \"none\")", "tools", "tools_not_supported")
    if use.forced and not json_object_calls(features):
        raise invalid(f"'tool_choice' {use.choice!r} cannot be forced for the model "
                      f"{model_id!r}: its tool calls are not <tool_call>{{\"name\", "
                      "\"arguments\"}</tool_call> objects; use \"auto\"",
                      "tool_choice", "tool_choice_not_supported")
    return [t.template_dict() for t in use.offered]


def _reply(parsed: ChatRequest, codec: TextCodec, tools: list[Any], thinking: bool,
           request_id: str) -> ChatReply | None:
    """How the answer is read: its reasoning and tool calls apart from its content. None
    when the model has neither (all of it is content, as before)."""
    features = codec.features
    if not tools and features.think is None:
        return None
    parallel = parsed.tools is None or parsed.tools.parallel
    splitter = ReplySplitter(features, tools=bool(tools), thinking=thinking,
                             max_calls=None if parallel else 1)
    parser = features.parse_tool_call
    if parser is None:
        return ChatReply(splitter, features, lambda text: None)
    return ChatReply(splitter, features, functools.partial(parse_calls, parser=parser,
                                                           tools=tools, request_id=request_id))
