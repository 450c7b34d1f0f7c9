"""The router's OpenAI-compatible HTTP app, over any engine.

    GET  /v1/models, /v1/models/{id}   the one model served, a card per name (``[serve]
                                       model_name``'s aliases), with its ``context_length``
                                       (the engine's: ``[serve] context_length`` caps it)
                                       and the same as vLLM's ``max_model_len``
    POST /v1/chat/completions          chat, whole or streamed (SSE)
    POST /v1/completions               text completion, whole or streamed
    POST /v1/responses, /responses     OpenAI's Responses API, stateless, whole or streamed
                                       (``responses/request.py``, ``responses/endpoint.py``)
    POST /v1/messages                  Anthropic's Messages API, whole or streamed (its
                                       events), errors in its shape (``anthropic/``)
    POST /v1/messages/count_tokens     the prompt's tokens, as the Messages API counts
    GET  /health                       liveness: always 200, never needs the key
    GET  /ready                        200 once ``ready()`` says so and ``readiness()``
                                       names nothing wrong, else 503
    GET  /metrics                      Prometheus text
    GET  /router/stats                 over a replica pool: each replica's load, health
                                       and counts (only when ``router_stats`` is given)

``/chat/completions``, ``/completions``, ``/models`` and ``/models/{id}`` are the same
endpoints without ``/v1`` (as vLLM and llama.cpp's server answer them), counted in
``/metrics`` under their ``/v1`` names. A request's ``model`` may name the model by any
of its names (``model_aliases``), and the answer's ``model`` echoes the one asked.
Sampling fields a request leaves out take ``sampling_defaults`` (the model's
``generation_config.json``: ``models/generation.py``). Every answer carries an
``x-request-id`` (``edge/requestid.py``); with ``allowed_origins``, CORS (``edge/cors.py``).

Completions are refused with 503 (code "not_ready") until ``ready()`` is true, and
with 503 (code "draining") while a node they need drains (``draining.py``; ``/ready``
is 503 "draining" then too);
``readiness()`` (a pipeline's stages not attached) only shows on ``/ready``:
completions still try, and fail with the engine's own 503 naming what is down.
Every error, unknown paths and methods included, is OpenAI's error JSON. Every
request gets a line in the access log (``edge/access.py``) when its response ends. The
app does not own the engine: whoever built it closes it.

``/router/stats`` shows replicas by node id; their addresses only when the
environment variable ``MLXCEL_ROUTER_STATS_VERBOSE`` is 1, true, yes or on (any
case), read once when the app is built; the body says which
(``addresses_redacted``). It needs the API key, as every route but ``/health`` (and
``/metrics`` when ``metrics_open``: ``[serve] metrics_require_key = false``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from mlxceld.api.anthropic.endpoint import Messages
from mlxceld.api.anthropic_errors import anthropic_response, speaks_anthropic
from mlxceld.api.chatting import Chats
from mlxceld.api.codec import TextCodec
from mlxceld.api.edge.access import log_access
from mlxceld.api.edge.admission import Admission
from mlxceld.api.edge.auth import require_api_key
from mlxceld.api.edge.cors import allow_origins
from mlxceld.api.edge.draining import Draining
from mlxceld.api.edge.metrics import (
    Continuities,
    Metrics,
    PromptCaches,
    Speculations,
    StageLinks,
    count_requests,
)
from mlxceld.api.edge.requestid import tag_requests
from mlxceld.api.endpoints import Endpoints, Readiness, RouterStats
from mlxceld.api.errors import ApiError, error_response
from mlxceld.api.generation import Sequencer
from mlxceld.api.ignoring import IgnoredFields, UnknownFields, announce_ignored
from mlxceld.api.outbox import SlowReaders
from mlxceld.api.reasoning import ReasoningField
from mlxceld.api.tokenizing import PromptTokenizer
from mlxceld.engine import Engine
from mlxceld.models.generation import SamplingDefaults

OPEN_PATHS = frozenset({"/health"})
ENDPOINTS = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions", "/health",
                       "/ready", "/metrics", "/router/stats", "/v1/responses",
                       "/v1/messages", "/v1/messages/count_tokens"})
# The paths without /v1 (vLLM's and llama.cpp's servers answer both): counted as these.
UNVERSIONED = {"/models": "/v1/models", "/chat/completions": "/v1/chat/completions",
               "/completions": "/v1/completions", "/responses": "/v1/responses"}
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
    api_key: str | Callable[[], str | None] | None = None,
    max_queued: int = 64,
    max_body_bytes: int = 4 << 20,
    max_tokens: int | None = None,
    ready: Callable[[], bool] | None = None,
    readiness: Readiness | None = None,
    draining: Draining | None = None,
    stage_links: StageLinks | None = None,
    router_stats: RouterStats | None = None,
    elastic: bool = False,
    prompt_caches: PromptCaches | None = None,
    continuity: Continuities | None = None,
    speculation: Speculations | None = None,
    model_aliases: Sequence[str] = (),
    sampling_defaults: SamplingDefaults | None = None,
    allowed_origins: Sequence[str] = (),
    reasoning_field: ReasoningField = "reasoning_content",
    unknown_fields: UnknownFields = "refuse",
    metrics_open: bool = False,
) -> ASGIApp:
    """``max_tokens``: the most tokens one completion may generate (the operator's
    ``[serve] max_tokens``; None: what is left of the context); a request that leaves
    ``max_tokens`` out gets that many, or what is left of the context if fewer, and one
    asking for more is refused naming ``max_tokens``. ``ready``: whether the engine serves
    yet (None: it always does); ``readiness``: what keeps it from serving well now (a
    JSON object with a ``message`` for ``/ready``'s 503 body), or None when nothing
    does; ``draining``: the nodes draining, set by the worker as its daemon says
    (``api/edge/draining.py``); ``stage_links``: over a pipeline, each stage link's stats
    (``PipelineEngine.stages``), for ``/metrics`` (``api/edge/metrics.py``); ``router_stats``:
    over a replica pool, its stats as JSON given whether to show addresses
    (``ReplicaEngine.stats``), served on ``/router/stats``; ``elastic``: the engine's
    ``max_batch`` changes (replicas found by discovery), admission follows it;
    ``prompt_caches``: the engine's prompt caches' stats, for ``/metrics``; ``continuity``:
    its counts of requests held, replayed and continued elsewhere, for ``/metrics``;
    ``speculation``: its speculative decoding's counters, for ``/metrics``;
    ``model_aliases``: the model's names besides ``model_id``; ``sampling_defaults``: what
    a request's left-out sampling fields are (None: OpenAI's); ``allowed_origins``: CORS's
    (``edge/cors.py``; none: no CORS); ``reasoning_field``: the key of a chat answer's reasoning
    (``[serve] reasoning_field``, ``reasoning.py``); ``unknown_fields``: refuse a request's
    unknown fields, or ignore them, saying so (``[serve] unknown_fields``, ``ignoring.py``).
    ``api_key``: the key every request but ``/health``'s must offer, or a function asked
    for it at each request (the worker's, which its daemon replaces on a reload;
    ``edge/auth.py``). ``metrics_open``: ``/metrics`` needs no API key. Prompts and
    completions are bounded by ``engine.context_length``."""
    if (max_tokens is not None and max_tokens < 1) or max_body_bytes < 1:
        raise ValueError(f"max_tokens and max_body_bytes must be >= 1, not "
                         f"{max_tokens} and {max_body_bytes}")
    admission = Admission(engine.max_batch, max_queued,
                          capacity=(lambda: engine.max_batch) if elastic else None)
    metrics = Metrics(queue_depth=lambda: admission.queued,
                      active_sequences=lambda: admission.active, model_id=model_id,
                      context_length=engine.context_length, stage_links=stage_links,
                      prompt_caches=prompt_caches, continuity=continuity,
                      speculation=speculation)
    drains = draining or Draining()
    names = (model_id, *(a for a in dict.fromkeys(model_aliases) if a != model_id))
    sequencer = Sequencer(engine, codec, admission, metrics, drains,
                          SlowReaders(metrics.slow_readers_cut))
    chats = Chats(engine, codec, sequencer,
                  PromptTokenizer(codec), model_id, max_tokens, max_body_bytes,
                  ready or (lambda: True), drains, names,
                  sampling_defaults or SamplingDefaults(), IgnoredFields(unknown_fields))
    endpoints = Endpoints(chats, metrics, readiness=readiness, router_stats=router_stats,
                          verbose=stats_verbose(), reasoning_field=reasoning_field)
    app = Starlette(routes=route_table(endpoints, Messages(chats)),
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                        Exception: _internal_error})
    told = announce_ignored(app)
    open_paths = OPEN_PATHS | ({"/metrics"} if metrics_open else set())
    key = api_key if api_key is None or callable(api_key) else _fixed(api_key)
    guarded: ASGIApp = told if key is None else require_api_key(told, key,
                                                                 open_paths=open_paths)
    served = allow_origins(guarded, allowed_origins) if allowed_origins else guarded
    return log_access(count_requests(tag_requests(served), metrics, ENDPOINTS,
                                     canonical=UNVERSIONED))


def _fixed(key: str) -> Callable[[], str | None]:
    return lambda: key


def route_table(e: Endpoints, messages: Messages) -> list[Route]:
    """Every route: the ``/v1`` ones, ``/router/stats`` over a replica pool, and the
    ``UNVERSIONED`` paths to the same endpoints."""
    routes = [
        Route("/v1/models", e.models),
        Route("/v1/models/{name:path}", e.model),
        Route("/v1/chat/completions", e.chat, methods=["POST"]),
        Route("/v1/completions", e.completions, methods=["POST"]),
        Route("/v1/responses", e.responses, methods=["POST"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/health", e.health),
        Route("/ready", e.ready),
        Route("/metrics", e.metrics_text),
        *([Route("/router/stats", e.router_stats)] if e.has_router_stats else []),
    ]
    versioned = {r.path: r for r in routes}
    routes += [Route(short, versioned[full].endpoint, methods=versioned[full].methods)
               for short, full in UNVERSIONED.items()]
    routes.append(Route("/models/{name:path}", e.model))
    return routes


def _refusal(request: Request, error: ApiError) -> Response:
    """OpenAI's error shape, or Anthropic's on the Messages API's paths."""
    if speaks_anthropic(request.url.path):
        return anthropic_response(error)
    return error_response(error)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _refusal(request, exc)


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
    return _refusal(request, error)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # starlette re-raises the exception after this answer, for the server to log.
    return _refusal(request, ApiError(500, "internal server error; see the server's log",
                                      "server_error", code="internal_error"))
