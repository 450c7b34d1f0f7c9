"""The router's OpenAI-compatible HTTP app, over any engine.

    GET  /v1/models, /v1/models/{id}   the one model served, with its ``context_length``
                                       (the engine's: ``[serve] context_length`` caps it)
    POST /v1/chat/completions          chat, whole or streamed (SSE)
    POST /v1/completions               text completion, whole or streamed
    GET  /health                       liveness: always 200, never needs the key
    GET  /ready                        200 once ``ready()`` says so and ``readiness()``
                                       names nothing wrong, else 503
    GET  /metrics                      Prometheus text
    GET  /router/stats                 over a replica pool: each replica's load, health
                                       and counts (only when ``router_stats`` is given)

Completions are refused with 503 (code "not_ready") until ``ready()`` is true, and
with 503 (code "draining") while a node they need drains (``draining.py``; ``/ready``
is 503 "draining" then too);
``readiness()`` (a pipeline's stages not attached) only shows on ``/ready``:
completions still try, and fail with the engine's own 503 naming what is down.
Every error, unknown paths and methods included, is OpenAI's error JSON. Every
request gets a line in the access log (``access.py``) when its response ends. The
app does not own the engine: whoever built it closes it.

``/router/stats`` shows replicas by node id; their addresses only when the
environment variable ``MLXCEL_ROUTER_STATS_VERBOSE`` is 1, true, yes or on (any
case), read once when the app is built; the body says which
(``addresses_redacted``). It needs the API key, as every route but ``/health``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from mlxceld.api.access import log_access
from mlxceld.api.admission import Admission
from mlxceld.api.auth import require_api_key
from mlxceld.api.codec import ChatTemplateError, TextCodec
from mlxceld.api.draining import Draining
from mlxceld.api.errors import ApiError, error_response, invalid
from mlxceld.api.formats import ChatFormat, Format, TextFormat
from mlxceld.api.generation import Sequencer
from mlxceld.api.metrics import (
    CONTENT_TYPE,
    Metrics,
    PromptCaches,
    StageLinks,
    count_requests,
)
from mlxceld.api.replies import ChatReply, ReplySplitter
from mlxceld.api.requests import (
    ChatRequest,
    Options,
    check_constraint,
    check_prompt_bytes,
    parse_chat,
    parse_completion,
    read_body,
    sampling_params,
)
from mlxceld.api.serving import CompletionResponse
from mlxceld.api.shapes import ModelCard, ModelList
from mlxceld.api.tokenizing import PromptTokenizer
from mlxceld.api.toolcalls import parse_calls
from mlxceld.api.toolgrammar import after_thinking, forced_constraint, json_object_calls
from mlxceld.engine import Constraint, Engine, GenerationRequest

OPEN_PATHS = frozenset({"/health"})
ENDPOINTS = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions", "/health",
                       "/ready", "/metrics", "/router/stats"})
STATS_VERBOSE_ENV = "MLXCEL_ROUTER_STATS_VERBOSE"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


def stats_verbose(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``/router/stats`` shows the replicas' addresses (``STATS_VERBOSE_ENV``)."""
    return environ.get(STATS_VERBOSE_ENV, "").strip().lower() in TRUE_WORDS


def build_router_app(
    engine: Engine,
    codec: TextCodec,
    *,
    model_id: str,
    api_key: str | None = None,
    max_queued: int = 64,
    max_body_bytes: int = 4 << 20,
    max_tokens: int | None = None,
    ready: Callable[[], bool] | None = None,
    readiness: Callable[[], Mapping[str, Any] | None] | None = None,
    draining: Draining | None = None,
    stage_links: StageLinks | None = None,
    router_stats: Callable[[bool], Any] | None = None,
    elastic: bool = False,
    prompt_caches: PromptCaches | None = None,
) -> ASGIApp:
    """``max_tokens``: the most tokens one completion may generate (the operator's
    ``[serve] max_tokens``; None: what is left of the context); a request that leaves
    ``max_tokens`` out gets that many, or what is left of the context if fewer, and one
    asking for more is refused naming ``max_tokens``. ``ready``: whether the engine serves
    yet (None: it always does); ``readiness``: what keeps it from serving well now (a
    JSON object with a ``message`` for ``/ready``'s 503 body), or None when nothing
    does; ``draining``: the nodes draining, set by the worker as its daemon says
    (``api/draining.py``); ``stage_links``: over a pipeline, each stage link's stats
    (``PipelineEngine.stages``), for ``/metrics`` (``api/metrics.py``); ``router_stats``:
    over a replica pool, its stats as JSON given whether to show addresses
    (``ReplicaEngine.stats``), served on ``/router/stats``; ``elastic``: the engine's
    ``max_batch`` changes (replicas found by discovery), admission follows it;
    ``prompt_caches``: the engine's prompt caches' stats, for ``/metrics``. Prompts and
    completions are bounded by ``engine.context_length``."""
    if (max_tokens is not None and max_tokens < 1) or max_body_bytes < 1:
        raise ValueError(f"max_tokens and max_body_bytes must be >= 1, not "
                         f"{max_tokens} and {max_body_bytes}")
    is_ready = ready or (lambda: True)
    admission = Admission(engine.max_batch, max_queued,
                          capacity=(lambda: engine.max_batch) if elastic else None)
    metrics = Metrics(queue_depth=lambda: admission.queued,
                      active_sequences=lambda: admission.active, model_id=model_id,
                      context_length=engine.context_length, stage_links=stage_links,
                      prompt_caches=prompt_caches)
    drains = draining or Draining()
    sequencer = Sequencer(engine, codec, admission, metrics, drains)
    tokenizer = PromptTokenizer(codec)
    card: ModelCard = {"id": model_id, "object": "model", "created": int(time.time()),
                       "owned_by": "mlxceld", "context_length": engine.context_length}

    async def models(request: Request) -> Response:
        body: ModelList = {"object": "list", "data": [card]}
        return JSONResponse(body)

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != model_id:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{model_id!r}", param="model", code="model_not_found")
        return JSONResponse(card)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready_route(request: Request) -> Response:
        if not is_ready():
            return JSONResponse({"status": "starting"}, status_code=503)
        problem = readiness() if readiness is not None else None
        if problem is not None:
            return JSONResponse({"status": "degraded", **problem}, status_code=503)
        if drains.active:
            return JSONResponse({"status": "draining", "nodes": drains.nodes(),
                                 "message": f"draining {', '.join(drains.nodes())}: new "
                                 "requests are not admitted"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics_text(request: Request) -> Response:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    verbose = stats_verbose()

    async def router_stats_route(request: Request) -> Response:
        assert router_stats is not None
        return JSONResponse(router_stats(verbose))

    def check_ready() -> float:
        arrived = time.monotonic()
        if not is_ready():
            raise ApiError(503, "the model is still loading; retry shortly", "server_error",
                           code="not_ready", headers={"Retry-After": "1"})
        drains.check()
        return arrived

    def respond(prompt: list[int], options: Options, fmt: Format, prompt_param: str,
                arrived: float, reply: ChatReply | None = None,
                constraint: Constraint | None = None) -> Response:
        params = sampling_params(options, prompt_tokens=len(prompt),
                                 context_length=engine.context_length,
                                 max_tokens_bound=max_tokens,
                                 prompt_param=prompt_param, vocab_size=codec.vocab_size)
        if constraint is not None:
            if params.constraint is not None:  # response_format's: one grammar at a time
                raise invalid("a forced 'tool_choice' and a 'response_format' cannot both "
                              "constrain the answer; drop one of them", "tool_choice")
            params = dataclasses.replace(params, constraint=constraint)
        return CompletionResponse(sequencer, GenerationRequest(fmt.id, prompt, params),
                                  options.stop, fmt, stream=options.stream, arrived=arrived,
                                  reply=reply)

    async def chat(request: Request) -> Response:
        arrived = check_ready()
        parsed = parse_chat(await read_body(request, max_body_bytes), model_id=model_id)
        tools = _template_tools(parsed, codec, model_id)
        size = sum(m.size for m in parsed.messages) + \
            sum(len(json.dumps(t)) for t in tools)
        check_prompt_bytes(size, context_length=engine.context_length, prompt_param="messages")
        options = parsed.options
        await check_constraint(options)
        try:
            prompt = await tokenizer.chat(list(parsed.messages), size, tools=tools or None,
                                          template_kwargs=dict(parsed.template_kwargs))
        except ChatTemplateError as exc:
            raise invalid(str(exc), "messages") from None
        thinking = codec.opens_thinking(prompt)
        if thinking and options.constraint is not None:  # the JSON is content, not reasoning
            options = dataclasses.replace(
                options, constraint=after_thinking(options.constraint, codec.features))
        use = parsed.tools
        forced = None
        if tools and use is not None and use.forced:
            forced = await forced_constraint(use.offered, codec.features,
                                             parallel=use.parallel, close_thinking=thinking)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model_id,
                         options.include_usage, options.logprobs is not None)
        return respond(prompt, options, fmt, "messages", arrived,
                       _reply(parsed, codec, tools, thinking, fmt.id), forced)

    async def completions(request: Request) -> Response:
        arrived = check_ready()
        parsed = parse_completion(await read_body(request, max_body_bytes), model_id=model_id)
        size = len(parsed.prompt.encode())
        check_prompt_bytes(size, context_length=engine.context_length, prompt_param="prompt")
        options = parsed.options
        await check_constraint(options)
        prompt = await tokenizer.prompt(parsed.prompt, size)
        fmt = TextFormat(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_id,
                         options.include_usage, options.logprobs is not None)
        return respond(prompt, options, fmt, "prompt", arrived)

    app = Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/models/{name:path}", model),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health),
            Route("/ready", ready_route),
            Route("/metrics", metrics_text),
            *([Route("/router/stats", router_stats_route)] if router_stats is not None else []),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            Exception: _internal_error},
    )
    guarded: ASGIApp = app if api_key is None else require_api_key(app, api_key,
                                                                    open_paths=OPEN_PATHS)
    return log_access(count_requests(guarded, metrics, ENDPOINTS))


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


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        error = ApiError(404, f"invalid URL ({where}): no such endpoint", code="unknown_url")
    elif exc.status_code == 405:
        error = ApiError(405, f"method not allowed ({where})", code="method_not_allowed",
                         headers=exc.headers)
    else:
        error = ApiError(exc.status_code, str(exc.detail), code="http_error", headers=exc.headers)
    return error_response(error)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # starlette re-raises the exception after this answer, for the server to log.
    return error_response(ApiError(500, "internal server error; see the server's log",
                                   "server_error", code="internal_error"))
