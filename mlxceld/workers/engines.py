"""The router worker's engine: ``make_engine`` builds the one its mode (``modes.py``)
names, a ``RouterEngine`` (``router_engine.py``) of that mode's class.

A local or tensor-parallel router (and a prefill or decode node) holds the model: a
repo id's weights are fetched first, the wired limit raised, and the weights read with
their progress in the worker's ``loading`` stat; told to stop meanwhile, it stops
(``runtime.unless_stopped``). The others hold only the tokenizer (``pipeline_router.py``,
``replica_router.py``), read on a thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from mlxceld import failpoints
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.engine.transport import TransportChoice, choose_transport, probe_host
from mlxceld.errors import ConfigError
from mlxceld.models.identity import read_model_config
from mlxceld.models.kvquant import check_kv_quant
from mlxceld.roles.options import RouterOptions
from mlxceld.workers.modes import (
    DisaggMode,
    DiscoveredMode,
    EngineMode,
    GroupsMode,
    HandoffMode,
    LocalMode,
    PipelineMode,
    ReplicasMode,
    TensorMode,
)
from mlxceld.workers.pipeline_router import load_pipeline
from mlxceld.workers.replica_router import load_replicas
from mlxceld.workers.router_engine import AppHooks, RouterEngine
from mlxceld.workers.runtime import WorkerContext, fetched_path, load_reporter, unless_stopped
from mlxceld.workers.wired import set_wired_limit

log = logging.getLogger(__name__)

Broke = Callable[[BaseException], None]  # the engine failed (called on its thread)


class LocalRouter(RouterEngine):
    """The model in this process; its stats carry the engine's ``prompt_cache``."""

    engine: LocalEngine

    def hooks(self) -> AppHooks:
        draft = self.engine.draft
        return AppHooks(prompt_caches=lambda: [({}, self.engine.prompt_cache_stats())],
                        speculation=None if draft is None else draft.snapshot)

    def refresh(self, stats: dict[str, Any], now: float) -> None:
        stats["prompt_cache"] = self.engine.prompt_cache_stats()
        if self.engine.draft is not None:  # speculative decoding's counters
            stats["speculative"] = self.engine.draft.snapshot()

    @property
    def vocab_size(self) -> int | None:
        return self.engine.vocab_size


class TensorRouter(LocalRouter):
    """Rank 0 of the tensor-parallel group: the engine drives the other ranks; ``/ready``
    is 503 naming a rank that went silent, while it is (``engine/heartbeats.py``)."""

    def hooks(self) -> AppHooks:
        return replace(super().hooks(), readiness=self.readiness)

    def readiness(self) -> dict[str, Any] | None:
        stalled = self.engine.stalled
        return None if stalled is None else {"reason": str(stalled)}


async def make_engine(mode: EngineMode, ctx: WorkerContext[RouterOptions],
                      broke: Broke) -> RouterEngine:
    """The engine of ``mode``, loaded (``broke``: told when the engine fails later). A
    draft model is refused by name where speculative decoding is not built: every mode
    but a local one, alone or as rank 0 of its tensor group (a pipeline's plan activated
    after the config was checked)."""
    if ctx.options.draft_model is not None \
            and not isinstance(mode, LocalMode | TensorMode):
        raise ConfigError(f"serve.draft_model: speculative decoding is built for the local "
                          f"engine only, not for this router's {type(mode).__name__}",
                          hint="leave draft_model out (--draft-model) for this node")
    match mode:
        case LocalMode() | HandoffMode():
            return await load_here(ctx, broke, tensor=None)
        case TensorMode():
            return await load_here(ctx, broke, tensor=mode)
        case PipelineMode(pipeline=pipe):
            return await asyncio.to_thread(load_pipeline, ctx, (pipe,))
        case GroupsMode(groups=groups):
            return await asyncio.to_thread(load_pipeline, ctx, groups)
        case ReplicasMode() | DiscoveredMode() | DisaggMode():
            return await asyncio.to_thread(load_replicas, ctx, mode)


async def load_here(ctx: WorkerContext[RouterOptions], broke: Broke,
                    tensor: TensorMode | None) -> LocalRouter:
    """The model loaded in this process (``tensor``: as rank 0 of its group)."""
    o = ctx.options
    set_wired_limit()
    path = await fetched_path(ctx, o.model)  # a repo id's weights, with progress
    # Its reports are queued before the thread ends, so they land before the pop.
    loaded = load_reporter(ctx, time.time(), failpoints.ROUTER_LAYER_S)
    draft = None if o.draft_model is None else await fetched_path(ctx, o.draft_model)
    if tensor is not None:
        engine, tokenizer = await tensor_engine(ctx, tensor, path, broke, loaded, draft)
        built: LocalRouter = TensorRouter(engine, tokenizer, path)
    else:
        engine, tokenizer = await unless_stopped(ctx, "load", functools.partial(
            load_local_engine, path, model_id=o.model_name, max_batch=o.max_batch,
            on_failure=broke, progress=loaded, context_length=o.context_length,
            prompt_cache_bytes=o.prompt_cache_bytes, kv_quant=o.kv_quant,
            draft_model=draft, num_draft_tokens=o.num_draft_tokens))
        built = LocalRouter(engine, tokenizer, path)
    ctx.stats.pop("loading", None)
    return built


async def group_transport(hosts: tuple[str, ...]) -> TransportChoice:
    """The group's backend (``engine/transport.py``): each rank's host reports as this one
    does, since every rank of this group runs here (its ring's host:port name them)."""
    here = await asyncio.to_thread(probe_host, "this host")
    return choose_transport([replace(here, host=h.rsplit(":", 1)[0]) for h in hosts])


async def tensor_engine(ctx: WorkerContext[RouterOptions], mode: TensorMode, path: str,
                        broke: Broke, loaded: Callable[[int, int], None], draft: str | None
                        ) -> tuple[LocalEngine, Any]:
    """Rank 0 of the tensor-parallel group: the model checked for the split, the ring
    joined (``engine.tensor.join_ring``: every rank within its ``RING_DEADLINE_S``), then
    this rank's slice loaded while the others load theirs (``load_tensor_engine``: the
    engine drives the group; ``draft``: its draft model's directory, loaded here)."""
    from mlxceld.engine.tensor import load_tensor_engine
    from mlxceld.workers.tensor_rank import check_split, join_group

    o = ctx.options
    check_split(path, o.model, mode.size)
    check_kv_quant(read_model_config(Path(path)), o.kv_quant,  # before the ranks load
                   source=str(Path(path) / "config.json"))
    transport = await group_transport(mode.hosts)
    log.info("tensor group of %d ranks: transport %s", mode.size, transport.line())
    ctx.stats["tensor"] = {"rank": 0, "size": mode.size, "transport": transport.backend,
                           "transport_reason": transport.reason}
    group = await join_group(ctx, 0, mode.hosts)
    log.info("router joined the ring of %d ranks at %s as rank 0", mode.size, mode.hosts[0])
    loaded_engine = await unless_stopped(ctx, "load", functools.partial(
        load_tensor_engine, path, group, model_id=o.model_name, max_batch=o.max_batch,
        on_failure=broke, progress=loaded, context_length=o.context_length,
        prompt_cache_bytes=o.prompt_cache_bytes, kv_quant=o.kv_quant, hosts=mode.hosts,
        draft_model=draft, num_draft_tokens=o.num_draft_tokens))
    return cast(tuple[LocalEngine, Any], loaded_engine)
