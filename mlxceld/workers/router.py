"""The ``router`` role: the OpenAI-compatible HTTP port in front of an engine.

Options (``RouterOptions``, from ``[serve]`` / ``--model`` / ``mlxctl serve``): model,
model_name (and model_aliases), host, port, max_batch, max_queued, max_tokens,
allowed_origins (CORS), generation_config (whether the model's generation_config.json
gives a request's sampling defaults: ``models/generation.py``), context_length (a cap on the
model's context: ``models/context.py``), prompt_cache_bytes (the local engine's prompt
cache, or each pipeline stage's), kv_quant (a quantized KV cache: the local engine's, its
tensor-parallel ranks', or each stage's through ``prepare``; a model that cannot keep one
is refused at start, exit 2, naming ``serve.kv_bits`` and its family), and the port's
connection bounds max_connections, header_timeout_s, body_timeout_s, and stage_silence_s
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
(``replica_peers.py``; ``Discovered`` adds and retires members) and its admission
follows the pool's ``max_batch``; its stats' ``replicas_discovered`` (how many members
discovery made) tells ``mlxctl status`` to name "none found yet" a problem.

On a prefill or decode node (``handoff``: ``HandoffOptions``, ``--node-role
prefill|decode``) it loads the model as above, binds no OpenAI port, and serves the
engine on the serving listener only (``workers/handoff_node.py``).

Its control channel's ``pipeline`` op (``pipeline_op``) moves it to another plan's
stages without a restart (``pipeline/switch.py``: new requests go to the new stages,
running ones end on the old); the daemon uses it when a drain's re-plan serves
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
nodes its requests need are draining (``api/draining.py``: 503 "draining" for new
requests, in-flight ones finish, the rest end at the deadline); the daemon says it
again every ``drain/service.py`` ``PUSH_EVERY_S``, so a restarted router learns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from mlxceld import failpoints
from mlxceld.api import MlxTextCodec, build_router_app, refusal_body
from mlxceld.api.draining import Draining, NodeDrain
from mlxceld.api.ignoring import UnknownFields
from mlxceld.api.reasoning import ReasoningField
from mlxceld.control.connections import ConnectionLimits, raise_file_limit
from mlxceld.control.server import SocketServer
from mlxceld.engine.loading import load_local_engine
from mlxceld.errors import ConfigError
from mlxceld.models.generation import SamplingDefaults, read_sampling_defaults
from mlxceld.pipeline.throughput import Throughput
from mlxceld.roles.options import PipelineOptions, RouterOptions
from mlxceld.types import JSON
from mlxceld.wire.address import format_address, parse_address
from mlxceld.workers.handoff_node import bind_serving, run_handoff_node
from mlxceld.workers.replica_router import Discovered, replica_engine, replica_links
from mlxceld.workers.runtime import (
    Stopped,
    WorkerContext,
    fetched_path,
    load_reporter,
    unless_stopped,
)
from mlxceld.workers.wired import set_wired_limit

log = logging.getLogger(__name__)

GRACEFUL_S = 10.0  # open streams get this long to finish when the router stops
STATS_EVERY_S = 1.0
BACKLOG = 1024  # connections the kernel queues for accept(): a burst of clients, not a flood


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    except OSError as exc:
        raise RuntimeError(
            f"cannot listen on {host}:{port}: {exc.strerror}; is another server using the "
            "port? pick another with --port or [serve] port") from None
    sock.setblocking(False)
    return sock


def pipeline_engine(ctx: WorkerContext[RouterOptions], pipe: PipelineOptions
                    ) -> tuple[Any, Any]:
    """The pipeline engine over the stages of ``pipe`` (a ``PipelineSwitch``: the
    ``pipeline`` op moves it to another plan's stages), and the tokenizer."""
    from mlx_lm.utils import load_tokenizer

    from mlxceld.models.context import served_context
    from mlxceld.models.identity import layer_count, read_model_config
    from mlxceld.models.kvquant import check_kv_quant
    from mlxceld.pipeline.switch import PipelineSwitch

    path = Path(ctx.options.model)
    config = read_model_config(path)
    layer_count(config)
    # The stages make each sequence's caches as prepare says: refused here, for them all.
    check_kv_quant(config, ctx.options.kv_quant, source=str(path / "config.json"))
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        path, eos_token_ids=config.get("eos_token_id"))
    context = served_context(config, ctx.options.context_length, ctx.options.model_name)
    eos = set(tokenizer.eos_token_ids)
    if ctx.options.replica_pipelines:
        return grouped_engine(ctx, (pipe, *ctx.options.replica_pipelines), context, eos), \
            tokenizer
    return PipelineSwitch(stages_engine(ctx, pipe, context, eos)), tokenizer


def grouped_engine(ctx: WorkerContext[RouterOptions], groups: tuple[PipelineOptions, ...],
                   context: int, eos: set[int]) -> Any:
    """Replica groups (``replicas/groups.py``): each group's stages behind a
    ``PipelineSwitch``, the groups behind one pool."""
    from mlxceld.pipeline.switch import PipelineSwitch
    from mlxceld.replicas.groups import GroupedPipelines, GroupMember

    members = [GroupMember(i, PipelineSwitch(stages_engine(ctx, pipe, context, eos)),
                           parse_address(pipe.stages[0].address).canonical())
               for i, pipe in enumerate(groups)]
    return GroupedPipelines(members, model_id=ctx.options.model_name, context_length=context)


def stages_engine(ctx: WorkerContext[RouterOptions], pipe: PipelineOptions, context: int,
                  eos: set[int]) -> Any:
    """A ``PipelineEngine`` over the stages of ``pipe``."""
    from mlxceld.pipeline import PipelineEngine, StageAddress
    from mlxceld.wire.address import parse_address

    o = ctx.options
    if ctx.keyring is None:
        raise RuntimeError("the pipeline engine needs the cluster secret and has none")
    stages = []
    for s in pipe.stages:
        where = parse_address(s.address)
        stages.append(StageAddress(s.node_id, where.host, where.port, s.rank, s.layers))
    return PipelineEngine(  # the keyring is changed in place by the daemon (supervisor/keys.py)
        stages, keyring=ctx.keyring, origin=pipe.coordinator,
        model_identity=pipe.model_identity, cluster=pipe.cluster, model_id=o.model_name,
        context_length=context, eos_token_ids=eos, max_batch=o.max_batch,
        silence_s=o.stage_silence_s, prompt_cache_bytes=o.prompt_cache_bytes,
        kv_quant=o.kv_quant)


def pipeline_op(ctx: WorkerContext[RouterOptions], switch: Any, eos: set[int],
                request: JSON) -> JSON:
    """The control channel's ``pipeline``: ``{"options": ROUTER-OPTIONS}``, this router's
    options with another plan's ``pipeline``. Where only the pipeline differs, new
    sequences go to the new stages at once and those running end on the old ones
    (``PipelineSwitch``); else ``ok`` is false and the daemon restarts the router."""
    from mlxceld.roles import ROUTER
    from mlxceld.roles.options import parse_options

    try:
        new = parse_options(ROUTER, request.get("options"), "options")
    except ConfigError as exc:
        return {"ok": False, "error": exc.message}
    assert isinstance(new, RouterOptions)
    old = ctx.options
    if old.replica_pipelines or new.replica_pipelines:
        return {"ok": False, "error": "a router over replica groups moves to another plan "
                "by a restart"}
    if new.pipeline is None or replace(new, pipeline=old.pipeline) != old:
        return {"ok": False, "error": "more than the pipeline's stages changed: restart"}
    switch.switch(stages_engine(ctx, new.pipeline, switch.context_length, eos))
    ctx.options = new
    return {"ok": True, "stages": len(new.pipeline.stages)}


async def serving_service(ctx: WorkerContext[RouterOptions], engine: Any,
                          path: str) -> Any:
    """The bound serving listener over ``engine`` (``path``: the local model's directory,
    whose identity routers must name), or None without ``serving`` or a secret."""
    o = ctx.options
    if o.serving is None or ctx.keyring is None:
        return None
    from mlxceld.models.identity import model_identity
    from mlxceld.replicas.service import ServingService

    identity = (o.pipeline.model_identity if o.pipeline is not None
                else await asyncio.to_thread(model_identity, Path(path)))
    service = ServingService(  # the keyring is changed in place by the daemon
        engine, node_id=o.serving.node_id, role="hybrid", model_identity=identity,
        cluster=o.serving.cluster, keyring=ctx.keyring, address=o.serving.address,
        silence_s=o.stage_silence_s,
        vocab_size=None if o.pipeline is not None else engine.vocab_size)  # stage 0 checks
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


def drain_op(draining: Draining, request: JSON) -> JSON:
    """The control channel's ``drain``: ``{"drains": [{"node": ID, "deadline": UNIX-S or
    null}, ...]}``, every drain in force (``[]``: none); answers the counts."""
    raw = request.get("drains")
    drains = []
    if not isinstance(raw, list):
        return {"ok": False, "error": "'drains' must be a list"}
    for item in raw:
        node = item.get("node") if isinstance(item, dict) else None
        deadline = item.get("deadline") if isinstance(item, dict) else None
        if not isinstance(node, str) or not (deadline is None or isinstance(deadline, float | int)):
            return {"ok": False, "error": "each drain must be {'node': ID, 'deadline': "
                    "UNIX-S or null}"}
        drains.append(NodeDrain(node, None if deadline is None else float(deadline)))
    draining.set(drains)
    return {"ok": True, "nodes": draining.nodes(), "in_flight": draining.in_flight,
            "finished": draining.finished, "ended": draining.ended}


def check_tensor_options(o: RouterOptions) -> None:
    """Tensor parallelism (``tp_size`` > 1) runs the whole model on this host, the router
    its rank 0: refused (``ConfigError``: exit 2, naming it) over a pipeline, replicas or
    as a prefill/decode node (not built), or without its ring's ports."""
    if o.tp_size <= 1:
        return
    for key, what in (("pipeline", "a pipeline stage's router"),
                      ("replicas", "a router over replicas (--node-role router)"),
                      ("handoff", "a prefill or decode node")):
        if getattr(o, key) is not None:
            raise ConfigError(f"tensor parallelism (tp_size {o.tp_size}) is not built for "
                              f"{what}: options.{key} must be null with tp_size > 1",
                              hint="set [serve] tp_size (--tp-size) to 1 there")
    if len(o.tp_hosts) != o.tp_size:
        raise ConfigError(f"options.tp_hosts names {len(o.tp_hosts)} ring addresses for "
                          f"tp_size {o.tp_size}: the daemon could not pick the ring's ports",
                          hint="check that 127.0.0.1 takes new TCP listeners; mlxctl logs "
                          "router")


async def tensor_engine(ctx: WorkerContext[RouterOptions], path: str,
                        engine_broke: Callable[[BaseException], None],
                        loaded: Callable[[int, int], None]) -> tuple[Any, Any]:
    """Rank 0 of the tensor-parallel group: the model checked for the split, the ring
    joined (``engine.tensor.join_ring``: every rank within its ``RING_DEADLINE_S``), then
    this rank's slice loaded while the others load theirs (``load_tensor_engine``: the
    engine drives the group)."""
    from mlxceld.engine.tensor import load_tensor_engine
    from mlxceld.models.identity import read_model_config
    from mlxceld.models.kvquant import check_kv_quant
    from mlxceld.workers.tensor_rank import check_split, join_group

    o = ctx.options
    check_split(path, o.model, o.tp_size)
    check_kv_quant(read_model_config(Path(path)), o.kv_quant,  # before the ranks load
                   source=str(Path(path) / "config.json"))
    ctx.stats["tensor"] = {"rank": 0, "size": o.tp_size}
    group = await join_group(ctx, 0, o.tp_hosts)
    log.info("router joined the ring of %d ranks at %s as rank 0", o.tp_size, o.tp_hosts[0])
    loaded_engine: tuple[Any, Any] = await unless_stopped(ctx, "load", functools.partial(
        load_tensor_engine, path, group, model_id=o.model_name, max_batch=o.max_batch,
        on_failure=engine_broke, progress=loaded, context_length=o.context_length,
        prompt_cache_bytes=o.prompt_cache_bytes, kv_quant=o.kv_quant))
    return loaded_engine


async def run(ctx: WorkerContext[RouterOptions]) -> int:
    o = ctx.options
    check_tensor_options(o)
    raise_file_limit()
    sock = listen(o.host, o.port) if o.handoff is None else socket.socket()  # none bound
    loop = asyncio.get_running_loop()
    broken: list[BaseException] = []

    def engine_broke(exc: BaseException) -> None:  # on the engine's thread
        broken.append(exc)
        loop.call_soon_threadsafe(ctx.stop)

    engine: Any
    discovered: Discovered | None = None
    path = o.model
    try:
        if o.pipeline is None and o.replicas is None:  # those routers hold no weights
            set_wired_limit()
        if o.replicas is not None:
            engine, tokenizer, discovered = await asyncio.to_thread(replica_engine, ctx,
                                                                     o.replicas)
        elif o.pipeline is not None:
            engine, tokenizer = await asyncio.to_thread(pipeline_engine, ctx, o.pipeline)
        else:
            path = await fetched_path(ctx, o.model)  # a repo id's weights, with progress
            # Its reports are queued before the thread ends, so they land before the pop.
            loaded = load_reporter(ctx, time.time(), failpoints.ROUTER_LAYER_S)
            if o.tp_size > 1:
                engine, tokenizer = await tensor_engine(ctx, path, engine_broke, loaded)
            else:
                engine, tokenizer = await unless_stopped(ctx, "load", functools.partial(
                    load_local_engine, path, model_id=o.model_name, max_batch=o.max_batch,
                    on_failure=engine_broke, progress=loaded, context_length=o.context_length,
                    prompt_cache_bytes=o.prompt_cache_bytes, kv_quant=o.kv_quant))
            ctx.stats.pop("loading", None)
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
    if o.handoff is not None:  # a prefill or decode node: no OpenAI port
        sock.close()
        return await run_handoff_node(ctx, engine, path, o.handoff, broken,
                                      stats_every_s=STATS_EVERY_S, graceful_s=GRACEFUL_S)
    pipeline = o.pipeline is not None
    pool = o.replicas is not None
    linked = pipeline or pool  # an engine with links to keep up; else a LocalEngine
    draining = Draining()
    ctx.ops["drain"] = lambda request: drain_op(draining, request)
    if discovered is not None:
        ctx.ops["replicas"] = discovered.op
    if linked:
        ctx.rekeyed.append(engine.rekey)
    if pipeline:
        eos = set(tokenizer.eos_token_ids)
        ctx.ops["pipeline"] = lambda request: pipeline_op(ctx, engine, eos, request)
    defaults = await asyncio.to_thread(sampling_defaults, o, path)
    app = build_router_app(engine, MlxTextCodec(tokenizer), model_id=o.model_name,
                           model_aliases=o.model_aliases, sampling_defaults=defaults,
                           allowed_origins=o.allowed_origins,
                           api_key=ctx.api_key, max_queued=o.max_queued,
                           max_tokens=o.max_tokens,
                           readiness=engine.readiness if linked else None,
                           router_stats=(lambda verbose: engine.stats(verbose=verbose))
                           if pool or o.replica_pipelines else None,
                           draining=draining, elastic=discovered is not None,
                           stage_links=engine.stages if pipeline else None,
                           prompt_caches=None if pool
                           else lambda: [({}, engine.prompt_cache_stats())],
                           reasoning_field=cast(ReasoningField, o.reasoning_field),
                           unknown_fields=cast(UnknownFields, o.unknown_fields),
                           metrics_open=o.metrics_open)
    limits = ConnectionLimits(o.max_connections, o.header_timeout_s, o.body_timeout_s)
    server = SocketServer(app, sock, graceful_timeout_s=GRACEFUL_S, limits=limits,
                          render=refusal_body, what="the OpenAI port", backlog=BACKLOG)
    started: asyncio.Future[None] = loop.create_future()
    throughput = Throughput()
    service = None
    try:
        service = await serving_service(ctx, engine, path)
        async with asyncio.TaskGroup() as tg:
            linking = tg.create_task(engine.keep_linked()) if linked else None
            tg.create_task(server.serve(started))
            await started
            if service is not None:
                tg.create_task(service.serve())
                ctx.stats["serving"] = format_address(service.host, service.port)
            ctx.stats.update(url=f"http://{o.host}:{o.port}/v1", model=o.model_name,
                             context_length=engine.context_length)
            ctx.ready()
            while not ctx.stopping.is_set():
                if not pool:  # a local engine's, or the pipeline's (its stages')
                    ctx.stats["prompt_cache"] = engine.prompt_cache_stats()
                if pipeline:
                    ctx.stats["stages"] = engine.stages()
                    throughput.sample(engine.tokens, loop.time())
                    rate = throughput.rate()
                    ctx.stats.update(tokens=engine.tokens, tokens_per_s=None if rate is None
                                     else round(rate, 2))
                if o.replicas is not None:
                    ctx.stats["replicas"] = replica_links(
                        engine, o.replicas, None if discovered is None else discovered.agents)
                    if discovered is not None:  # how many members discovery made
                        ctx.stats["replicas_discovered"] = len(discovered.agents)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ctx.stopping.wait(), STATS_EVERY_S)
            server.request_shutdown()
            if service is not None:  # as the OpenAI port: its streams get GRACEFUL_S
                await service.drain(GRACEFUL_S)
                await service.aclose()
            if linking is not None:
                linking.cancel()
    finally:
        if service is not None:
            await service.aclose()
        if discovered is not None:
            await discovered.aclose()
        await engine.aclose()
    if broken:  # exit non-zero: the supervisor restarts us with a fresh engine
        raise RuntimeError(f"the engine failed: {broken[0]!r}") from broken[0]
    return 0
