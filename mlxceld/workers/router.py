"""The ``router`` role: the OpenAI-compatible HTTP port in front of an engine.

Its options name one engine mode (``modes.py``: ``engine_mode``), which ``engines.py``'s
``make_engine`` builds as a ``RouterEngine`` of that mode's class; what follows holds for
them all, and says which mode does what.

Options (``RouterOptions``, from ``[serve]`` / ``--model`` / ``mlxctl serve``): model,
model_name (and model_aliases), host, port, max_batch, max_queued, max_tokens,
allowed_origins (CORS), generation_config (whether the model's generation_config.json
gives a request's sampling defaults: ``models/generation.py``), context_length (a cap on the
model's context: ``models/context.py``), prompt_cache_bytes (the local engine's prompt
cache, or each pipeline stage's), kv_quant (a quantized KV cache: the local engine's, its
tensor-parallel ranks', or each stage's through ``prepare``; a model that cannot keep one
is refused at start, exit 2, naming ``serve.kv_bits`` and its family), and the port's
connection bounds max_connections, header_timeout_s, body_timeout_s, write_timeout_s (the
write deadline: ``guard/connections.py``'s ``write_stall_s``), and stage_silence_s
(a pipeline stage's heartbeat bound), reasoning_field and unknown_fields (the app's:
``api/reasoning.py``, ``api/ignoring.py``) (``config/serve.py``), and metrics_open (``/metrics``
without the API key: ``[serve] metrics_require_key = false``). The API key, if any, arrives
on the bootstrap pipe. With ``pipeline`` (``PipelineOptions``, from a cluster config:
stages, coordinator, model_identity, cluster) the engine drives remote stages and only the
tokenizer is loaded here; the cluster secret then arrives on the bootstrap pipe too. Its
stats carry ``context_length`` (the context served) and, over a local engine or a
pipeline, ``prompt_cache`` (``types.PromptCacheStats``; a pipeline's:
``PipelineCacheStats``) for ``mlxctl status``.

Start-up binds the port first (a port in use fails at once, named), then loads the
model (the supervisor's start timeout covers it), then serves and reports ready. It
raises its soft file limit to the hard one first (mlx-lm, as it is imported, sets them
to 2048 and 4096), and keeps its connections below it. While a single-host router
reads its weights, its stats carry ``loading`` (``types.LoadProgress``: parameter bytes
read of those to read, layer by layer, ``models/reading.py``), which ``mlxctl status``,
systemd's STATUS line and ``mlxctl serve`` show. A model named by its Hugging Face repo
id is fetched first (``models/fetch.py``: ``fetch_whole``, the weight files the cache
lacks), its bytes in the same stat with step ``downloading``. Told to stop while it
loads (SIGTERM: the daemon stopping, ``mlxctl unserve``), it exits 0 at once, the load
left unfinished (``runtime.unless_stopped``).

Over a pipeline the engine keeps its stage links up in the background from the
start; ``GET /ready`` is 503 naming the stages not attached (completions are
not held back: they dial on demand and fail with a 503 naming the stage; while
a stage is silent they get that 503 at once, with ``Retry-After``), and
the worker's stats (``stages``: each stage's state, last error and heartbeat round
trip; ``tokens`` generated and ``tokens_per_s`` over the last ``pipeline/throughput.py``
``WINDOW_S``; refreshed every ``STATS_EVERY_S``) show in ``mlxctl status``.

Over replica groups (``replica_pipelines``: a cluster TOML's ``[cluster] replicas``,
`mlxctl cluster activate --replicas`) each group is a pipeline engine of its own and the
groups one pool (``replicas/groups.py``): ``GET /ready`` is 503 only while no group has
all its stages attached, ``GET /router/stats`` shows each group (``replica-<i>``), and
the stats' ``stages`` every group's stages, each with its ``replica``.
On a router node (``replicas``: ``ReplicasOptions``, ``--node-role router``) the engine
is a pool of replicas (``workers/replica_router.py``): only the tokenizer is loaded here,
the cluster secret arrives on the bootstrap pipe, the links to the replicas are kept up
in the background from the start, ``GET /ready`` is 503 while no replica is up,
``GET /router/stats`` answers the pool's stats, and the worker's stats carry
``replicas`` (each one's node id, agent address, state and last error) for
``mlxctl status``. A router finding its replicas by discovery (``ReplicasOptions.discover``)
starts with none; its control channel's ``replicas`` op takes the daemon's candidates
(``daemon/replica_peers.py``; ``Discovered`` adds and retires members) and its admission
follows the pool's ``max_batch``; its stats' ``replicas_discovered`` (how many members
discovery made) tells ``mlxctl status`` to name "none found yet" a problem.

On a prefill or decode node (``handoff``: ``HandoffOptions``, ``--node-role
prefill|decode``) it loads the model as above, binds no OpenAI port, and serves the
engine on the serving listener only (``workers/handoff_node.py``).

Its control channel's ``pipeline`` op (``pipeline_router.py``'s ``pipeline_op``) moves
it to another plan's stages without a restart (``pipeline/switch.py``: new requests go
to the new stages, running ones end on the old); the daemon uses it when a drain's re-plan serves
(``daemon.serve_pipeline``), and restarts the router where it is refused (always over
replica groups).

With ``serving`` (``ServingOptions``: the daemon holds the cluster secret) it serves its
engine to the cluster's routers too, on the serving listener (``replicas/service.py``:
MXCL channel 1 at ``serving.address``; port 0: an ephemeral one), bound once the model is
loaded (a port in use fails the start, named); those sequences are batched with the
OpenAI port's own, and a router silent for ``stage_silence_s`` has its sequences
cancelled. The bound address is in its stats (``serving``: ``mlxctl status``). On stop
the listener takes no new sequence (``draining``) and its sequences get ``GRACEFUL_S`` to
finish, as the OpenAI port's streams do.

Its control channel's ``drain`` op (``drain_op``) is how the daemon tells it which
nodes its requests need are draining (``api/edge/draining.py``: 503 "draining" for new
requests, in-flight ones finish, the rest end at the deadline); the daemon says it
again every ``drain/service.py`` ``PUSH_EVERY_S``, so a restarted router learns it. With
the serving listener, a drain in force drains it too (``handoff_node.drain_serving``):
the routers' new sequences are refused with ``draining``, theirs are counted in flight
with the OpenAI port's, and the answer's ``senders`` says who still sends work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import cast

from mlxceld.api import MlxTextCodec, build_router_app, refusal_body
from mlxceld.api.edge.draining import Draining, parse_drains
from mlxceld.api.ignoring import UnknownFields
from mlxceld.api.reasoning import ReasoningField
from mlxceld.control.server import SocketServer
from mlxceld.errors import ConfigError
from mlxceld.guard.connections import SEND_BUFFER_BYTES, ConnectionLimits, raise_file_limit
from mlxceld.models.generation import SamplingDefaults, read_sampling_defaults
from mlxceld.replicas.service import ServingService
from mlxceld.roles.options import RouterOptions
from mlxceld.types import JSON
from mlxceld.wire.address import format_address
from mlxceld.workers.engines import make_engine
from mlxceld.workers.handoff_node import bind_serving, drain_serving, run_handoff_node
from mlxceld.workers.modes import HandoffMode, engine_mode
from mlxceld.workers.router_engine import RouterEngine
from mlxceld.workers.runtime import Stopped, WorkerContext

log = logging.getLogger(__name__)

GRACEFUL_S = 10.0  # open streams get this long to finish when the router stops
STATS_EVERY_S = 1.0
BACKLOG = 1024  # connections the kernel queues for accept(): a burst of clients, not a flood


def listen(host: str, port: int, *, share: bool = False) -> socket.socket:
    """The OpenAI port's socket (``share``: SO_REUSEPORT, beside the daemon's stand-in
    of a tensor group across hosts, which lets it go once this router runs)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG,
                                    reuse_port=share)
    except OSError as exc:
        raise RuntimeError(
            f"cannot listen on {host}:{port}: {exc.strerror}; is another server using the "
            "port? pick another with --port or [serve] port") from None
    sock.setblocking(False)
    return sock


async def serving_service(ctx: WorkerContext[RouterOptions], built: RouterEngine
                          ) -> ServingService | None:
    """The bound serving listener over the engine, or None without ``serving`` or a
    secret."""
    o = ctx.options
    if o.serving is None or ctx.keyring is None:
        return None
    service = ServingService(  # the keyring is changed in place by the daemon
        built.engine, node_id=o.serving.node_id, role="hybrid",
        model_identity=await built.serving_identity(), cluster=o.serving.cluster,
        keyring=ctx.keyring, address=o.serving.address, silence_s=o.stage_silence_s,
        vocab_size=built.vocab_size)  # None over a pipeline: stage 0 checks
    await bind_serving(service, o.serving.address)
    return service


def sampling_defaults(o: RouterOptions, path: str) -> SamplingDefaults:
    """The defaults of a request's sampling fields: with ``generation_config`` "auto", the
    model's ``generation_config.json``'s (``path``: its local directory, or its repo id
    over a pipeline or replicas, whose metadata the router has fetched), else OpenAI's."""
    if o.generation_config != "auto":
        return SamplingDefaults()
    from mlxceld.models.fetch import local_model

    defaults = read_sampling_defaults(local_model(path))
    if defaults.changed():
        log.info("sampling defaults from %s's generation_config.json: %s", o.model_name,
                 " ".join(f"{k}={v}" for k, v in defaults.changed().items()))
    return defaults


def drain_op(draining: Draining, request: JSON,
             service: ServingService | None = None) -> JSON:
    """The control channel's ``drain``: ``{"drains": [{"node": ID, "deadline": UNIX-S or
    null}, ...]}``, every drain in force (``[]``: none); answers the counts. With the
    serving listener (a hybrid node) it drains too (``drain_serving``): the counts are the
    OpenAI port's and the routers' together, and ``senders`` says who still sends work."""
    try:
        drains = parse_drains(request)
    except ValueError as exc:
        return {"ok": False, "error": str(exc)}
    draining.set(drains)
    answer: JSON = {"ok": True, "nodes": draining.nodes(), "in_flight": draining.in_flight,
                    "finished": draining.finished, "ended": draining.ended}
    clients = [{"sender": "clients of the OpenAI port", "sequences": draining.in_flight}]
    if service is None:
        return {**answer, "senders": clients if draining.in_flight else []}
    routers = drain_serving(service, drains)
    return {**answer, **{k: answer[k] + routers[k] for k in ("in_flight", "finished", "ended")},
            "senders": (clients if draining.in_flight else []) + routers["senders"]}


async def run(ctx: WorkerContext[RouterOptions]) -> int:
    o = ctx.options
    mode = engine_mode(o)
    raise_file_limit()
    handoff = isinstance(mode, HandoffMode)
    # A handoff node binds no OpenAI port.
    sock = socket.socket() if handoff else listen(o.host, o.port, share=o.share_port)
    loop = asyncio.get_running_loop()
    broken: list[BaseException] = []

    def engine_broke(exc: BaseException) -> None:  # on the engine's thread
        broken.append(exc)
        loop.call_soon_threadsafe(ctx.stop)

    try:
        built = await make_engine(mode, ctx, engine_broke)
    except Stopped:  # the worker exits 0 (runtime.run_worker)
        sock.close()
        raise
    except ConfigError as exc:  # a repo id's weights it cannot fetch: restarts cannot help
        sock.close()
        raise ConfigError(f"cannot load model {o.model!r}: {exc.message}",
                          hint=exc.hint) from exc
    except Exception as exc:
        sock.close()
        raise RuntimeError(f"cannot load model {o.model!r}: {exc}") from exc
    if isinstance(mode, HandoffMode):  # a prefill or decode node: no OpenAI port
        sock.close()
        return await run_handoff_node(ctx, built.engine, built.path, mode.handoff, broken,
                                      stats_every_s=STATS_EVERY_S, graceful_s=GRACEFUL_S)
    try:
        await serve(ctx, built, sock)
    finally:
        await built.aclose()
    if broken:  # exit non-zero: the supervisor restarts us with a fresh engine
        raise RuntimeError(f"the engine failed: {broken[0]!r}") from broken[0]
    return 0


async def serve(ctx: WorkerContext[RouterOptions], built: RouterEngine,
                sock: socket.socket) -> None:
    """The OpenAI port on ``sock`` over ``built`` (and the serving listener, with
    ``serving``) until the worker is told to stop."""
    o = ctx.options
    draining = Draining()
    ctx.ops["drain"] = lambda request: drain_op(draining, request)
    built.attach(ctx)
    defaults = await asyncio.to_thread(sampling_defaults, o, built.path)
    hooks = built.hooks()
    ctx.guards_api_key = True
    app = build_router_app(built.engine, MlxTextCodec(built.tokenizer), model_id=o.model_name,
                           model_aliases=o.model_aliases, sampling_defaults=defaults,
                           allowed_origins=o.allowed_origins,
                           api_key=lambda: ctx.api_key,  # the api_key op replaces it
                           max_queued=o.max_queued, max_tokens=o.max_tokens,
                           readiness=hooks.readiness, router_stats=hooks.router_stats,
                           draining=draining, elastic=hooks.elastic,
                           stage_links=hooks.stage_links, prompt_caches=hooks.prompt_caches,
                           continuity=hooks.continuity, speculation=hooks.speculation,
                           reasoning_field=cast(ReasoningField, o.reasoning_field),
                           unknown_fields=cast(UnknownFields, o.unknown_fields),
                           metrics_open=o.metrics_open)
    limits = ConnectionLimits(o.max_connections, o.header_timeout_s, o.body_timeout_s,
                              write_stall_s=o.write_timeout_s,
                              send_buffer_bytes=SEND_BUFFER_BYTES)
    server = SocketServer(app, sock, graceful_timeout_s=GRACEFUL_S, limits=limits,
                          render=refusal_body, what="the OpenAI port", backlog=BACKLOG)
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    service = None
    try:
        service = await serving_service(ctx, built)
        if service is not None:  # a drain of this node drains the serving listener too
            ctx.ops["drain"] = lambda request: drain_op(draining, request, service)
        async with asyncio.TaskGroup() as tg:
            linking = tg.create_task(built.keep_linked())
            tg.create_task(server.serve(started))
            await started
            if service is not None:
                tg.create_task(service.serve())
                ctx.stats["serving"] = format_address(service.host, service.port)
            ctx.stats.update(url=f"http://{o.host}:{o.port}/v1", model=o.model_name,
                             context_length=built.engine.context_length)
            ctx.ready()
            await report(ctx, built)
            server.request_shutdown()
            if service is not None:  # as the OpenAI port: its streams get GRACEFUL_S
                await service.finish_held(GRACEFUL_S)
                await service.aclose()
            linking.cancel()
    finally:
        if service is not None:
            await service.aclose()


async def report(ctx: WorkerContext[RouterOptions], built: RouterEngine) -> None:
    """Refresh the engine's stats every ``STATS_EVERY_S`` until the worker is told to
    stop."""
    loop = asyncio.get_running_loop()
    while not ctx.stopping.is_set():
        built.refresh(ctx.stats, loop.time())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctx.stopping.wait(), STATS_EVERY_S)
