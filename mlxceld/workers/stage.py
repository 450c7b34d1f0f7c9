"""The ``stage`` role: one pipeline stage behind an MXCL listener on channel 1.

Options (``StageOptions``, built by the daemon from the cluster config): model,
layers [start, end), node_id, rank, address (our listener, also the identity we
dial the next stage with), coordinator, upstream, downstream, first (on the last
of 2+ stages: where decoding continues), last (on the first of 2+ stages: who
sends ``next``) (addresses or null), model_identity, cluster, standby (a
stage prepared by a two-phase assignment: loaded and listening, refusing
coordinators until the control channel's ``activate`` op switches it on), and
silence_s (the heartbeat's bound on its links to other stages and on the
connections it accepts, ``[serve] stage_silence_s``). The
cluster secret arrives on the bootstrap pipe; a stage without one refuses to start.

Its health answer carries its progress (steps, the last step's time, whether it
has steps to run: ``types.WorkerProgress``), which the supervisor's watchdog reads.

Start-up binds the listener first (a port in use fails at once, named), loads
only this stage's layers, then accepts connections and reports ready. A model
named by its Hugging Face repo id (its directory a snapshot of huggingface_hub's
cache holding the config, index and tokenizer) first gets the shards this
stage needs and the snapshot lacks (``models/fetch.py``: ``fetch_stage``),
reported as ``loading`` with step ``downloading`` (bytes fetched of those to
fetch). While it loads, its stats carry ``loading`` (``types.LoadProgress``:
parameter bytes read of those to read, updated layer by layer), which the
daemon's assignment waits on (``cluster/assignment/stagehost.py``) and ``mlxctl
status`` shows. A model it cannot fetch or load (``ConfigError`` from
``fetch_stage`` or ``load_stage``: a repo or shard it cannot fetch, a family it
does not split, a missing shard, a bad config.json) ends the worker with
``EXIT_CONFIG``, the reason
in its exit record, "stage stage-1 failed to load layers [2, 4): ...": its
supervisor marks it failed and does not restart it.

Stopping (SIGTERM, from the daemon or anyone): the stage drains first
(``StageService.drain``): new sequences are refused (``draining``: the router
answers 503 naming the stage, with Retry-After), the sequences it holds run to
their end, for at most ``pipeline.stage.DRAIN_S`` (15 s, under the model
workers' 20 s stop timeout); then the listener and the links close and the
worker exits 0. Told to stop before its model is loaded (a two-phase assignment
aborted while it prepared, the daemon stopping), it exits 0 at once, its load left
unfinished (``runtime.unless_stopped``), rather than at the end of a load that may take
minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxceld import failpoints
from mlxceld.errors import ConfigError
from mlxceld.net import Listener
from mlxceld.pipeline.kvstore import StageCache
from mlxceld.pipeline.sequences import StagePlace
from mlxceld.pipeline.stage import DRAIN_S, StageService
from mlxceld.roles.options import StageOptions
from mlxceld.supervisor.ops import Activate
from mlxceld.types import JSON
from mlxceld.wire.address import parse_address
from mlxceld.workers.runtime import (
    WorkerContext,
    fetched_path,
    load_reporter,
    progress_report,
    unless_stopped,
)
from mlxceld.workers.stage_tensor import close_group, load_leader

if TYPE_CHECKING:  # mlx: only once serving
    from mlxceld.engine.speculative import Draft

log = logging.getLogger(__name__)

STATS_EVERY_S = 1.0
CACHE_SHARE = 0.25  # of the memory available after loading: the prompt cache's default


def default_cache_bytes(ranks: int = 1) -> int:
    """The prompt cache's bound when the router names none: a quarter of the memory this
    host has available once the stage's weights are loaded (what the plan left it: its
    headroom, which running sequences' caches share), shared by the ``ranks`` of a
    tensor-parallel stage on this host (``ranks_here``)."""
    import psutil

    return int(psutil.virtual_memory().available * CACHE_SHARE) // max(1, ranks)


def ranks_here(tp_hosts: tuple[str, ...]) -> int:
    """How many of a tensor-parallel stage's ranks (``tp_hosts``, ring addresses, rank 0's
    first) run on rank 0's host: each holds about as many prompt-cache bytes as rank 0's
    store counts (``pipeline/kvmirror.py``); 1 for a stage of its own."""
    if not tp_hosts:
        return 1
    here = parse_address(tp_hosts[0]).host
    return sum(1 for h in tp_hosts if parse_address(h).host == here)


def cache_stats(cache: StageCache) -> JSON:
    """The prompt cache for ``mlxctl status``: what it holds, and how it was used, over
    every router's entries (``kvstore.StageCache``)."""
    nbytes, entries, budget, s = cache.totals()
    return {"bytes": nbytes, "entries": entries, "budget": budget,
            "hits": s.hits, "misses": s.misses, "tokens_reused": s.tokens_reused,
            "kept": s.kept, "evicted": s.evicted}


def place_of(o: StageOptions) -> StagePlace:
    return StagePlace(
        node_id=o.node_id, rank=o.rank, layers=o.layers, address=o.address,
        coordinator=o.coordinator, upstream=o.upstream, downstream=_host_port(o.downstream),
        model_identity=o.model_identity, cluster=o.cluster, first=_host_port(o.first),
        last=o.last)


def _host_port(address: str | None) -> tuple[str, int] | None:
    if address is None:
        return None
    hp = parse_address(address)
    return hp.host, hp.port


async def run(ctx: WorkerContext[StageOptions]) -> int:
    o = ctx.options
    if ctx.keyring is None:
        raise RuntimeError("a pipeline stage needs the cluster secret and has none; "
                           "see mlxctl secret --help")
    place = place_of(o)
    keyring = ctx.keyring  # changed in place by the daemon (supervisor/keys.py)
    me = parse_address(place.address)  # a name binds every address it resolves to
    service: StageService | None = None
    leader: Any = None  # a tensor-parallel stage's StageLeader (rank 0), once formed

    async def handler(stream: Any) -> None:
        assert service is not None
        await service.handle(stream)

    listener = Listener(me.host, me.port, keyring=keyring, identity_of_server=place.address,
                        channels={1}, handler=handler,
                        name=f"stage {place.node_id} listener")
    try:
        await listener.start()
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {place.address} for stage {place.node_id}: "
                           f"{exc.strerror}; is another stage using the port?") from None
    try:
        from mlxceld.models.fetch import fetch_stage
        from mlxceld.models.slicing import load_stage
        from mlxceld.wire.mx_tensors import wire_dtype
        from mlxceld.workers.wired import set_wired_limit

        set_wired_limit()

        fetched = load_reporter(ctx, time.time(), step="downloading")
        # Its reports are queued before the thread ends, so they all land before this pop.
        try:
            path = await unless_stopped(ctx, "download", lambda: fetch_stage(
                Path(o.model), place.layers, fetched))
            since = time.time()
            loaded = load_reporter(ctx, since, failpoints.STAGE_LAYER_S)  # tests: slow disk
            if o.tp_size > 1:  # rank 0 of a tensor-parallel group (workers/stage_tensor.py)
                leader = await load_leader(ctx, str(path))
                model = leader.model
            else:
                model = await unless_stopped(ctx, "load", lambda: load_stage(
                    path, *place.layers, loaded))
        except ConfigError as exc:  # exits EXIT_CONFIG: failed, not restarted (runtime.py)
            raise ConfigError(f"stage {place.node_id} failed to load layers "
                              f"[{place.layers[0]}, {place.layers[1]}): {exc.message}",
                              hint=exc.hint) from exc
        try:
            draft = None if o.draft_model is None else await load_draft(ctx, path, model)
        except ConfigError as exc:  # exits EXIT_CONFIG: failed, not restarted (runtime.py)
            raise ConfigError(f"stage {place.node_id} failed to load its draft model "
                              f"{o.draft_model}: {exc.message}", hint=exc.hint) from exc
        ctx.stats.pop("loading", None)
        log.info("stage %s loaded %d parameter bytes in %.1f s", place.node_id, model.nbytes,
                 time.time() - since)
        wire = wire_dtype(model.dtype)
        if wire is None:
            raise RuntimeError(f"stage {place.node_id}: activations of dtype {model.dtype} "
                               "cannot travel on the wire")
        service = StageService(model, place, keyring, wire, standby=o.standby,
                               silence_s=o.silence_s, tokenizer_path=path,
                               cache_bytes=default_cache_bytes(
                                   ranks_here(o.tp_hosts) if leader is not None else 1),
                               leader=leader, draft=draft)
        active = service
        if leader is not None:  # the group broke: its sequences fail, then this process ends
            leader.on_broken(service.group_broke)

        def activate(request: JSON) -> JSON:
            active.activate()
            ctx.stats.update(standby=False)
            return {"ok": True}

        ctx.ops[Activate.OP] = activate
        ctx.rekeyed.append(service.rekey)
        ctx.progress = lambda: progress_report(active.stats.steps, active.stats.last_step_at,
                                               active.busy_since)
        async with asyncio.TaskGroup() as tg:
            compute = tg.create_task(service.run())
            serving = tg.create_task(listener.serve())
            await listener.wait_accepting()
            ctx.stats.update(stage=place.node_id, layers=list(place.layers),
                             address=place.address, standby=service.standby)
            ctx.ready()
            log.info("stage %s serves layers [%d, %d) on %s", place.node_id, *place.layers,
                     place.address)
            while not ctx.stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ctx.stopping.wait(), STATS_EVERY_S)
                ctx.stats.update(sequences=service.sequences, queued=service.queued,
                                 rtt_ms=service.links_rtt_ms(), steps=service.stats.steps,
                                 tokens=service.stats.tokens, refused=service.stats.refused,
                                 compute_s=round(service.stats.compute_s, 6),
                                 inline=service.stats.inline,
                                 prompt_cache=cache_stats(service.cache))
                if draft is not None:  # speculative decoding's counters (speculating.py)
                    ctx.stats.update(speculative={
                        **draft.snapshot(), "draft_s": round(service.draft_clock.seconds, 6),
                        "drafted_ahead": service.draft_clock.ahead})
            ctx.stats.update(draining=True)
            await service.finish_held(asyncio.get_running_loop().time() + DRAIN_S)
            await listener.aclose()
            await service.aclose()
            compute.cancel()
            await serving
    finally:
        await listener.aclose()
        if leader is not None:
            await asyncio.to_thread(close_group, leader)
    return 0


async def load_draft(ctx: WorkerContext[StageOptions], model: Path, stage: Any) -> Draft:
    """The last stage's draft (``[cluster] draft_model``): fetched when a repo id, its
    tokenizer checked against the model's in ``model`` (``models/drafts.py``), loaded; the
    stage's caches (``stage``: its slice) and the draft's must trim. On a tensor-parallel
    stage it is rank 0's alone, whole (``pipeline/tensor_stage.py``): the followers run
    the passes it proposes, told where each starts."""
    o = ctx.options
    assert o.draft_model is not None
    from mlx_lm import load
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    from mlxceld.engine.speculative import Draft
    from mlxceld.models.drafts import check_draft

    path = Path(await fetched_path(ctx, o.draft_model))
    check_draft(model, path, "[cluster] draft_model")
    draft = Draft(await unless_stopped(ctx, "load", lambda: load(str(path))[0]),
                  o.num_draft_tokens)
    if not (can_trim_prompt_cache(stage.make_cache())
            and can_trim_prompt_cache(make_prompt_cache(draft.model))):
        raise ConfigError("the model's (or the draft's) KV cache cannot be trimmed back to "
                          "the accepted tokens (a sliding window's), which speculative "
                          "decoding needs", hint="leave [cluster] draft_model out for this "
                          "model")
    log.info("stage %s speculates with draft %s, k = %d", o.node_id, path,
             o.num_draft_tokens)
    return draft
