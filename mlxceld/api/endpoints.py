"""The router app's endpoints: one method each, over the app's parts.

An endpoint reads its request, asks the parts (the shared chat path ``Chats``, the
metrics, the engine's hooks), and answers; what it raises is answered by the app's
handlers (``app.py``) in OpenAI's error shape, or Anthropic's on the Messages API's
paths.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mlxceld.api.answering import CompletionResponse
from mlxceld.api.chatting import Chats
from mlxceld.api.edge.metrics import CONTENT_TYPE, Metrics
from mlxceld.api.errors import ApiError
from mlxceld.api.formats import ChatFormat, TextFormat
from mlxceld.api.reasoning import ReasoningField
from mlxceld.api.requests import check_constraint, check_prompt_bytes, parse_chat, parse_completion
from mlxceld.api.responses.endpoint import respond
from mlxceld.api.shapes import ModelCard, ModelList
from mlxceld.engine import GenerationRequest

Readiness = Callable[[], Mapping[str, Any] | None]
RouterStats = Callable[[bool], Any]


class Endpoints:
    """``readiness``: what keeps the engine from serving well now (None: nothing);
    ``router_stats``: a replica pool's stats given whether to show addresses;
    ``verbose``: whether ``/router/stats`` shows them."""

    def __init__(self, chats: Chats, metrics: Metrics, *, readiness: Readiness | None,
                 router_stats: RouterStats | None, verbose: bool,
                 reasoning_field: ReasoningField) -> None:
        self.chats = chats
        self.metrics = metrics
        self.readiness = readiness
        self._router_stats = router_stats
        self.verbose = verbose
        self.reasoning_field = reasoning_field
        created = int(time.time())
        context = chats.engine.context_length
        self.cards: dict[str, ModelCard] = {
            name: {"id": name, "object": "model", "created": created, "owned_by": "mlxceld",
                   "context_length": context, "max_model_len": context}
            for name in chats.names}

    @property
    def has_router_stats(self) -> bool:
        """Whether ``/router/stats`` is served (over a replica pool)."""
        return self._router_stats is not None

    # -- the model and the server ----------------------------------------------------------

    async def models(self, request: Request) -> Response:
        body: ModelList = {"object": "list", "data": list(self.cards.values())}
        return JSONResponse(body)

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.cards:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.chats.model_id!r}", param="model", code="model_not_found")
        return JSONResponse(self.cards[name])

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if not self.chats.is_ready():
            return JSONResponse({"status": "starting"}, status_code=503)
        problem = self.readiness() if self.readiness is not None else None
        if problem is not None:
            return JSONResponse({"status": "degraded", **problem}, status_code=503)
        drains = self.chats.draining
        if drains.active:
            return JSONResponse({"status": "draining", "nodes": drains.nodes(),
                                 "message": f"draining {', '.join(drains.nodes())}: new "
                                 "requests are not admitted"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type=CONTENT_TYPE)

    async def router_stats(self, request: Request) -> Response:
        assert self._router_stats is not None
        return JSONResponse(self._router_stats(self.verbose))

    # -- generating ------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        chats = self.chats
        arrived = chats.check_ready()
        parsed = await chats.read(request, lambda body, ignored: parse_chat(
            body, model_id=chats.model_id, aliases=chats.names, defaults=chats.defaults,
            ignored=ignored))
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), parsed.options.model,
                         parsed.options.include_usage, parsed.options.logprobs is not None,
                         self.reasoning_field)
        prepared = await chats.prepare(parsed, fmt.id)
        return CompletionResponse(chats.sequencer, prepared.request, prepared.stops, fmt,
                                  stream=prepared.options.stream, arrived=arrived,
                                  reply=prepared.reply)

    async def completions(self, request: Request) -> Response:
        chats = self.chats
        arrived = chats.check_ready()
        parsed = await chats.read(request, lambda body, ignored: parse_completion(
            body, model_id=chats.model_id, aliases=chats.names, defaults=chats.defaults,
            ignored=ignored))
        size = len(parsed.prompt.encode())
        check_prompt_bytes(size, context_length=chats.engine.context_length,
                           prompt_param="prompt")
        options = parsed.options
        await check_constraint(options)
        prompt = await chats.tokenizer.prompt(parsed.prompt, size)
        fmt = TextFormat(f"cmpl-{uuid.uuid4().hex}", int(time.time()), options.model,
                         options.include_usage, options.logprobs is not None)
        return CompletionResponse(chats.sequencer, GenerationRequest(
            fmt.id, prompt, chats.params(prompt, options, "prompt")), options.stop, fmt,
            stream=options.stream, arrived=arrived)

    async def responses(self, request: Request) -> Response:
        return await respond(self.chats, request)
