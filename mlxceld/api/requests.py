"""``POST /v1/chat/completions`` and ``POST /v1/completions`` bodies, read and checked.

Bytes in, a frozen request out, or an ``ApiError`` (400, 404, 413) that names
the field. Nothing is silently ignored: ``surface.py`` holds the table of every field
each endpoint knows (honoured, opaque, another server's hint accepted as a no-op, or
refused), and a field it does not know is refused by name (or, with ``[serve]
unknown_fields = "warn"``, listed in ``ignored`` and not read). Here:

- ``n`` other than 1: refused (400, param "n"); one choice per request.
- sampling controls, each checked and honoured (``engine/processors.py`` says how):
  ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI's, over the
  generated tokens), ``repetition_penalty`` in (0, ``MAX_REPETITION_PENALTY``] (vLLM's
  and mlx-lm's; 1 is off), ``logit_bias`` (an object of at most ``MAX_LOGIT_BIAS`` token
  ids, as decimal strings, each in the tokenizer's vocabulary, to numbers in
  [-100, 100]), ``min_p`` in [0, 1], ``top_k`` >= 0 (0 is off; -1 too, as vLLM's
  "off"), ``seed``; vLLM's ``min_tokens`` (0 to ``max_tokens``: no end-of-sequence token
  before that many were generated) and ``ignore_eos`` (none at all: the answer runs to
  ``max_tokens`` or a stop string), both refused with a constraint (a grammar that is
  complete admits only the end-of-sequence token).
- ``stop``: a string or up to ``MAX_STOPS`` strings (Continue sends 6), each 1 to
  ``MAX_STOP_CHARS`` characters.
- ``reasoning_effort`` (OpenAI's: none, minimal, low, medium or high) and OpenRouter's
  ``reasoning`` object (``{"effort": ...}``, Open WebUI's shape; ``{"enabled": false}``
  is effort none): the same setting, two values of it refused (400). It reaches the model
  through the chat template (``reasoning.py``).
- ``logprobs``: chat: a boolean, with ``top_logprobs`` 0 to 20 (which needs
  ``logprobs`` true); completions: an integer 0 to 5, the alternatives per token.
- ``user`` (and chat's ``safety_identifier``, ``prompt_cache_key``, ``metadata``):
  accepted as the caller's opaque labels; nothing is stored, so nothing uses them.
- ``tools``, ``tool_choice``, ``parallel_tool_calls`` and an assistant message's
  ``tool_calls``: see ``tools/choice.py``; a ``role: "tool"`` message's ``tool_call_id`` goes
  to the template (left out, as templates that ignore it allow).
- ``chat_template_kwargs``: an object of extra variables for the chat template (such as
  ``{"enable_thinking": false}``); names the router itself gives the template
  (``TEMPLATE_OWN_KWARGS``) are refused.
- ``response_format``: ``{"type": "text"}`` (free text, as if absent), ``{"type":
  "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name",
  "schema" (required), "strict", "description"}}``: the output is constrained token by
  token to match (``engine/constraints.py``; ``strict`` is checked to be a boolean, the
  schema is always enforced); vLLM's ``guided_json`` (a schema) is the same, not with it.
  Anything else, or a schema llguidance cannot honour (a keyword it does not implement,
  an unknown ``format``, a remote ``$ref``, over ``MAX_CONSTRAINT_BYTES``), is refused
  (400, param "response_format..."; a schema no finite value matches names its own field)
  before the request is admitted (``check_constraint``). JSON comes out compact.
- ``model`` may be left out: a router serves one model. It may name the model by any of
  its names (``[serve] model_name = "a,b"``: ``aliases``), and the answer's ``model``
  echoes the name asked (the primary one when left out).
- sampling fields left out take ``defaults`` (the model's ``generation_config.json``,
  ``models/generation.py``), else OpenAI's.
- both ``max_completion_tokens`` and ``max_tokens``: the first wins (OpenAI's
  newer name). Left out: what is left of the context (OpenAI's behaviour), or the
  operator's ``[serve] max_tokens`` if that is fewer; asking for more than is left,
  or than the operator's bound, is refused naming the field, as OpenAI does.
- message content parts (``[{"type": "text", "text": ...}]``) are joined with
  newlines; other part types (images, audio) are refused. Role "developer" is
  read as "system". An assistant message may have null content. A message's own
  fields are those of its role (``surface.ROLE_FIELDS``): ``name`` and an assistant's
  ``reasoning_content`` (or ``reasoning``, vLLM's newer name for it: both, different,
  are refused) go to the template, ``cache_control`` (on a message or a text part) is a
  hint (the prompt cache is automatic), the rest are refused by their path.
- ``prompt`` is a string or a list of one string; token ids are refused (the
  router could not check them against the vocabulary).
- ``stream_options`` is read only when ``stream`` is true.

A prompt is measured twice. Before tokenizing, its UTF-8 bytes (a chat's message
contents together) against ``PROMPT_BYTES_PER_TOKEN`` times the context length: a
prompt longer than that cannot fit the context, and is refused (400,
``context_length_exceeded``) without the seconds and the memory tokenizing it would
take. After tokenizing, its tokens against the context (``sampling_params``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from mlxceld.api.codec import ChatMessage, ChatRole
from mlxceld.api.errors import ApiError, invalid
from mlxceld.api.fields import Fields, check_text, member, parse_object, show
from mlxceld.api.reasoning import parse_effort, parse_history_reasoning
from mlxceld.api.surface import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ROLE_FIELDS,
    TEXT_PART_FIELDS,
    check_fields,
)
from mlxceld.api.tools.choice import ToolUse, parse_called_tools, parse_tool_use
from mlxceld.engine import MAX_TOP_LOGPROBS, Constraint, SamplingParams
from mlxceld.engine.base import MAX_LOGIT_BIAS
from mlxceld.engine.constraints import ConstraintError, EndlessSchema, compile_grammar
from mlxceld.guard.bodies import read_bounded
from mlxceld.models.generation import SamplingDefaults

# No tokenizer packs more text in a token, over a whole prompt: English runs at about 4
# bytes a token, code at 3, a long run of one repeated character at the longest token.
PROMPT_BYTES_PER_TOKEN = 32
MAX_STOPS = 16  # Continue's templates send 6; StopMatcher scans each for every piece
MAX_STOP_CHARS = 256
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_REPETITION_PENALTY = 10.0
MAX_BIAS = 100.0  # |a logit_bias value| (OpenAI's)
MAX_COMPLETION_LOGPROBS = 5  # completions' ``logprobs`` (OpenAI's bound)
# What the router passes to the chat template itself, or what would change what it renders.
TEMPLATE_OWN_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "chat_template"})
SCHEMA_NAME_CHARS = 64  # OpenAI's limit on response_format.json_schema.name
CHAT_ROLES: dict[str, ChatRole] = {"system": "system", "developer": "system", "user": "user",
                          "assistant": "assistant", "tool": "tool"}


@dataclass(frozen=True)
class Options:
    """What both endpoints share: the model, sampling, stops and streaming."""

    model: str
    max_tokens: int | None  # None: what is left of the context, up to the server's bound
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # token id, bias; sorted by id
    logprobs: int | None = None  # None: none; else the top alternatives per token
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    max_tokens_param: str = "max_tokens"  # which name the request gave it by
    constraint: Constraint | None = None  # from response_format; None: free text
    schema_param: str = "response_format.json_schema.schema"  # where its schema came from
    min_tokens: int = 0  # no end-of-sequence token before this many (vLLM's)
    ignore_eos: bool = False  # no end-of-sequence token at all (vLLM's, llama.cpp's)


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    options: Options
    tools: ToolUse | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # chat_template_kwargs, in order
    reasoning_effort: str | None = None  # reasoning.EFFORTS; None: the template's default


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    options: Options


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it grows past ``limit`` bytes."""
    return await read_bounded(
        request, limit,
        too_large=ApiError(413, f"the request body is larger than {limit} bytes",
                           param=None, code="request_too_large"),
        went_away=invalid("the client went away before sending the whole body"))


OPENAI_DEFAULTS = SamplingDefaults()


def parse_chat(body: bytes, *, model_id: str, aliases: Collection[str] = (),
               defaults: SamplingDefaults = OPENAI_DEFAULTS,
               ignored: list[str] | None = None) -> ChatRequest:
    """``aliases``: the model's other names; ``defaults``: of the sampling fields;
    ``ignored``: unknown fields are ignored, their paths put there, rather than refused
    (``[serve] unknown_fields = "warn"``)."""
    obj = parse_object(body)
    check_fields(obj, CHAT_FIELDS, ignored=ignored)
    fields = Fields(obj)
    return ChatRequest(messages=_messages(fields, ignored),
                       options=_options(fields, model_id, _chat_logprobs(fields), aliases,
                                        defaults),
                       tools=parse_tool_use(fields), template_kwargs=_template_kwargs(fields),
                       reasoning_effort=parse_effort(fields, ignored))


def parse_completion(body: bytes, *, model_id: str, aliases: Collection[str] = (),
                     defaults: SamplingDefaults = OPENAI_DEFAULTS,
                     ignored: list[str] | None = None) -> CompletionRequest:
    obj = parse_object(body)
    check_fields(obj, COMPLETION_FIELDS, ignored=ignored)
    fields = Fields(obj)
    logprobs = fields.integer("logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(prompt=_prompt(fields),
                             options=_options(fields, model_id, logprobs, aliases, defaults))


def _chat_logprobs(fields: Fields) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs``: None, or how many
    alternatives each token carries."""
    wanted = fields.boolean("logprobs", False)
    top = fields.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def check_prompt_bytes(size: int, *, context_length: int, prompt_param: str) -> None:
    """Refuse a prompt of ``size`` UTF-8 bytes that cannot fit the context, before it is
    tokenized."""
    most = context_length * PROMPT_BYTES_PER_TOKEN
    if size > most:
        raise invalid(f"the prompt is {size} bytes long; this model's maximum context length "
                      f"is {context_length} tokens, which holds at most {most} bytes of prompt "
                      f"({PROMPT_BYTES_PER_TOKEN} a token); shorten the prompt", prompt_param,
                      "context_length_exceeded")


def sampling_params(options: Options, *, prompt_tokens: int, context_length: int,
                    max_tokens_bound: int | None, prompt_param: str,
                    vocab_size: int | None = None) -> SamplingParams:
    """The engine's parameters, once the prompt's length is known. ``max_tokens_bound``:
    the operator's ``[serve] max_tokens`` (None: only the context bounds a completion);
    ``vocab_size``: the tokenizer's, which every ``logit_bias`` id must be below."""
    outside = [t for t, _ in options.logit_bias if vocab_size is not None and t >= vocab_size]
    if outside:
        raise invalid(f"'logit_bias' names token id {outside[0]}, outside this model's "
                      f"vocabulary (ids 0 to {vocab_size - 1 if vocab_size else 0}); use ids "
                      "of its tokenizer", "logit_bias")
    left = context_length - prompt_tokens
    if left < 1:
        raise invalid(f"this model's maximum context length is {context_length} tokens, and "
                      f"the prompt has {prompt_tokens} tokens, which leaves {max(left, 0)} for "
                      "the completion; shorten the prompt", prompt_param, "context_length_exceeded")
    max_tokens = options.max_tokens
    if max_tokens is None:
        max_tokens = left if max_tokens_bound is None else min(max_tokens_bound, left)
    elif max_tokens_bound is not None and max_tokens > max_tokens_bound:
        name = options.max_tokens_param
        raise invalid(f"{name} is {max_tokens}, but this server generates at most "
                      f"{max_tokens_bound} tokens a completion; lower {name} (or leave it "
                      "out to get as many as the server allows)", name)
    elif max_tokens > left:
        raise invalid(f"this model's maximum context length is {context_length} tokens, and "
                      f"the prompt has {prompt_tokens} tokens, which leaves {left} for the "
                      f"completion, but {max_tokens} were asked for; lower "
                      f"{options.max_tokens_param}", options.max_tokens_param,
                      "context_length_exceeded")
    if options.min_tokens > max_tokens:
        raise invalid(f"'min_tokens' is {options.min_tokens}, more than the {max_tokens} "
                      f"tokens the completion may have; lower 'min_tokens' (or raise "
                      f"{options.max_tokens_param})", "min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=options.temperature,
                          top_p=options.top_p, top_k=options.top_k,
                          seed=None if options.seed is None else options.seed % 2**64,
                          min_p=options.min_p, presence_penalty=options.presence_penalty,
                          frequency_penalty=options.frequency_penalty,
                          repetition_penalty=options.repetition_penalty,
                          logit_bias=options.logit_bias, logprobs=options.logprobs,
                          constraint=options.constraint, min_tokens=options.min_tokens,
                          ignore_eos=options.ignore_eos)


async def check_constraint(options: Options) -> None:
    """Refuse a ``response_format`` llguidance cannot honour (400 naming it), compiled in a
    thread: a large schema takes a while."""
    if options.constraint is None:
        return
    try:
        await asyncio.to_thread(compile_grammar, options.constraint)
    except ConstraintError as exc:
        raise constraint_refused(exc, options.schema_param) from None


def constraint_refused(exc: ConstraintError, schema: str = "response_format") -> ApiError:
    """A constraint the engine cannot honour, as the client's fault (see the docstring)."""
    param = schema if isinstance(exc, EndlessSchema) else "response_format"
    return invalid(f"{param!r} cannot be honoured: {exc}", param, "invalid_response_format")


def _options(fields: Fields, model_id: str, logprobs: int | None,
             aliases: Collection[str] = (), defaults: SamplingDefaults = OPENAI_DEFAULTS
             ) -> Options:
    model = fields.string("model")
    if model is not None and model != model_id and model not in aliases:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{model_id!r} (see GET /v1/models)", param="model",
                       code="model_not_found")
    n = fields.integer("n", 1)
    if n is not None and n != 1:
        raise invalid(f"'n' must be 1: one choice per request is served, not {n}", "n")
    max_tokens_param = "max_completion_tokens"
    max_tokens = fields.integer(max_tokens_param, 1)
    if max_tokens is None:
        max_tokens_param = "max_tokens"
        max_tokens = fields.integer(max_tokens_param, 1)
    stream = fields.boolean("stream", False)
    constraint = _response_format(fields)
    min_tokens = fields.integer("min_tokens", 0) or 0
    ignore_eos = fields.boolean("ignore_eos", False)
    if constraint is not None and (min_tokens or ignore_eos):
        name = "ignore_eos" if ignore_eos else "min_tokens"
        raise invalid(f"{name!r} cannot be honoured with a constrained answer (its grammar "
                      "may admit nothing but the end); leave out one of them", name)
    return Options(
        model=model or model_id,
        max_tokens=max_tokens,
        temperature=fields.number("temperature", defaults.temperature, 0.0, 2.0),
        top_p=fields.number("top_p", defaults.top_p, 0.0, 1.0, low_open=True),
        top_k=_top_k(fields, defaults.top_k),
        seed=fields.integer("seed", *SEED_RANGE),
        min_p=fields.number("min_p", defaults.min_p, 0.0, 1.0),
        presence_penalty=fields.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=fields.number("repetition_penalty", defaults.repetition_penalty, 0.0,
                                         MAX_REPETITION_PENALTY, low_open=True),
        logit_bias=_logit_bias(fields),
        logprobs=logprobs,
        stop=_stops(fields),
        stream=stream,
        include_usage=stream and _include_usage(fields),
        max_tokens_param=max_tokens_param,
        constraint=constraint,
        schema_param="guided_json" if fields.get("guided_json") else Options.schema_param,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
    )


def _top_k(fields: Fields, default: int) -> int:
    """``top_k``: 0 (and -1, vLLM's way to say it) is off; absent: ``default``."""
    value = fields.get("top_k")
    if isinstance(value, int) and not isinstance(value, bool) and value < -1:
        raise invalid(f"'top_k' must be an integer >= 0 (0 or -1: off), not {show(value)}",
                      "top_k")
    got = fields.integer("top_k", -1)
    return default if got is None else max(got, 0)


def _logit_bias(fields: Fields) -> tuple[tuple[int, float], ...]:
    value = fields.object("logit_bias", "an object of token ids to numbers")
    if value is None:
        return ()
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' holds {len(value)} token ids; at most {MAX_LOGIT_BIAS} "
                      "are allowed", "logit_bias")
    biases = Fields(value, "logit_bias")
    pairs: dict[int, float] = {}
    for key in value:
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise invalid(f"'logit_bias' keys must be token ids (decimal integers), not "
                          f"{show(key)}", "logit_bias")
        pairs[int(key)] = biases.number(key, 0.0, -MAX_BIAS, MAX_BIAS)
    return tuple(sorted(pairs.items()))


def _response_format(fields: Fields) -> Constraint | None:
    guided = fields.object("guided_json", "an object (a JSON schema)")
    value = fields.object("response_format")
    if guided is not None and value is not None:
        raise invalid("'guided_json' and 'response_format' both constrain the answer; send "
                      "one of them", "guided_json")
    if guided is not None:
        return Constraint("json_schema", json.dumps(guided, ensure_ascii=False))
    if value is None:
        return None
    inner = Fields(value, "response_format")
    kind = inner.string("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise invalid(f"'response_format.type' must be one of text, json_object, json_schema, "
                      f"not {show(kind)}", "response_format.type")
    spec = inner.object("json_schema")
    if spec is None:
        raise invalid("'response_format.json_schema' is required when its type is "
                      "json_schema", "response_format.json_schema")
    schema_fields = Fields(spec, "response_format.json_schema")
    name = schema_fields.string("name")
    if name is None or not 1 <= len(name) <= SCHEMA_NAME_CHARS or \
            not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise invalid(f"'response_format.json_schema.name' must be 1 to {SCHEMA_NAME_CHARS} "
                      f"letters, digits, '_' or '-', not {show(name)}",
                      "response_format.json_schema.name")
    schema_fields.string("description")
    schema_fields.boolean("strict", False)
    schema = schema_fields.object("schema", "an object (a JSON schema)")
    if schema is None:
        raise invalid("'response_format.json_schema.schema' is required: the JSON schema "
                      "the output must match", "response_format.json_schema.schema")
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))


def _include_usage(fields: Fields) -> bool:
    value = fields.object("stream_options")
    if value is None:
        return False
    return Fields(value, "stream_options").boolean("include_usage", False)


def _stops(fields: Fields) -> tuple[str, ...]:
    value = fields.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise fields.wrong("stop", "a string or an array of strings")
    if len(items) > MAX_STOPS:
        raise invalid(f"'stop' holds {len(items)} strings; at most {MAX_STOPS} are allowed",
                      "stop")
    for text in items:
        if not text or len(text) > MAX_STOP_CHARS:
            raise invalid(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, not "
                          f"{len(text)}", "stop")
        check_text(text, "stop")
    return tuple(items)


def _prompt(fields: Fields) -> str:
    value = fields.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise invalid("'prompt' is empty; send the text to complete", "prompt")
        return check_text(value, "prompt")
    if value is None:
        raise invalid("'prompt' is required", "prompt")
    if isinstance(value, list) and not value:
        raise invalid("'prompt' is empty; send the text to complete", "prompt")
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        raise invalid("a prompt of token ids is not supported; send the text", "prompt")
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        raise invalid(f"'prompt' holds {len(value)} prompts; send one per request", "prompt")
    raise fields.wrong("prompt", "a string")


def _messages(fields: Fields, ignored: list[str] | None) -> tuple[ChatMessage, ...]:
    value = fields.array("messages", "an array of messages")
    if value is None:
        raise invalid("'messages' is required", "messages")
    if not value:
        raise invalid("'messages' is empty; send at least one message", "messages")
    return tuple(_message(item, f"messages[{i}]", ignored) for i, item in enumerate(value))


def _template_kwargs(fields: Fields) -> tuple[tuple[str, Any], ...]:
    value = fields.object("chat_template_kwargs")
    if value is None:
        return ()
    ours = sorted(TEMPLATE_OWN_KWARGS & set(value))
    if ours:
        raise invalid(f"'chat_template_kwargs' sets {', '.join(map(repr, ours))}, which the "
                      "server sets itself; send messages and tools as their own fields",
                      f"chat_template_kwargs.{ours[0]}")
    return tuple(value.items())


def _message(item: Any, path: str, ignored: list[str] | None) -> ChatMessage:
    fields = member(item, path)
    name = fields.string("role")
    if name is None:
        raise invalid(f"'{path}.role' is required", f"{path}.role")
    role = CHAT_ROLES.get(name)
    if role is None:
        raise invalid(f"'{path}.role' must be one of {', '.join(CHAT_ROLES)}, not {show(name)}",
                      f"{path}.role")
    check_fields(item, ROLE_FIELDS[role], path, ignored)
    calls = parse_called_tools(fields) if role == "assistant" else ()
    call_id = fields.string("tool_call_id") if role == "tool" else None
    sender = fields.string("name")
    reasoning = parse_history_reasoning(fields) if role == "assistant" else None
    content = fields.get("content")
    if content is None and role == "assistant":
        text = ""
    elif isinstance(content, str):
        text = check_text(content, f"{path}.content")
    elif isinstance(content, list):
        text = "\n".join(_text_part(part, f"{path}.content[{j}]", ignored)
                         for j, part in enumerate(content))
    else:
        raise fields.wrong("content", "a string or an array of content parts")
    return ChatMessage(role, text, calls, call_id, sender, reasoning)


def _text_part(part: Any, path: str, ignored: list[str] | None) -> str:
    fields = member(part, path)
    part_type = fields.string("type")
    if part_type != "text":
        raise invalid(f"'{path}.type' must be \"text\" (only text is served), not "
                      f"{show(part_type)}", f"{path}.type")
    text = fields.string("text")
    if text is None:
        raise invalid(f"'{path}.text' is required", f"{path}.text")
    check_fields(part, TEXT_PART_FIELDS, path, ignored)
    return text
