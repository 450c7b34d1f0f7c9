"""The ``stage_tp`` role: one rank >= 1 of a tensor-parallel pipeline stage (issue 32's
mesh, inside one host), and rank 0's side of the same start-up (``load_leader``, called by
the ``stage`` worker, ``workers/stage.py``).

Options (``StageTensorOptions``, from ``[serve] tp_size`` on a stage host:
``daemon/roster.py``): model, layers (the stage's [start, end)), node_id (the stage's),
rank, tp_hosts (the ring: ``host:port`` per rank on 127.0.0.1, rank 0 the ``stage``
worker). No cluster secret, no port of its own besides its ring's.

Start-up, on every rank alike: the stage's shards fetched (a model named by its Hugging
Face repo id, ``models/fetch.py``'s ``fetch_stage``), the model checked for the split
(``tensor_rank.check_split``: ``ConfigError``, exit 2, not restarted), the ring joined
(``engine/ring.py``'s ``join_ring``, its deadline ending the process with status 1,
naming the ranks it waited for), then the stage's layers loaded and split over the group
(``pipeline/tensor_stage.py``'s ``load_tensor_stage``: ``loading`` in its stats). Rank 0
then leads (``StageLeader``); a follower reports ready and takes rank 0's steps
(``run_stage_follower``) on a thread of its own while its loop answers health probes and
stats (``tensor``: its rank, the group's size, the groups it ran, the sequences it holds
and the prompt-cache entries it mirrors of rank 0's, with their bytes).

A follower ends when rank 0 closes the group (exit 0: the stage stopped), when the group
breaks (rank 0 or another rank gone: it exits non-zero, its exit record naming why; the
supervisor restarts the whole group, ``supervisor/groups.py``), or when told to stop
(exit 0: its thread, blocked in the ring, is left to the process's end).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Final

from mlxceld import failpoints
from mlxceld.errors import ConfigError
from mlxceld.roles.options import StageOptions, StageTensorOptions
from mlxceld.workers.runtime import Stopped, WorkerContext, load_reporter, unless_stopped
from mlxceld.workers.tensor_rank import check_split

log = logging.getLogger(__name__)
WORKER: Final = "stage-tp"  # the followers' names: stage-tp-<rank> (roster.STAGE_TP_GROUP)


async def _fetched(ctx: WorkerContext[Any], model: str, layers: tuple[int, int],
                   node_id: str) -> str:
    """The stage's local directory: a repo id's shards of ``layers`` fetched first."""
    from mlxceld.models.fetch import fetch_stage

    fetched = load_reporter(ctx, time.time(), step="downloading")
    try:
        return str(await unless_stopped(ctx, "download", lambda: fetch_stage(
            Path(model), layers, fetched)))
    except ConfigError as exc:
        raise ConfigError(f"stage {node_id} failed to fetch layers [{layers[0]}, "
                          f"{layers[1]}): {exc.message}", hint=exc.hint) from exc


async def _joined_and_loaded(ctx: WorkerContext[Any], path: str, model: str,
                             layers: tuple[int, int], node_id: str, rank: int,
                             hosts: tuple[str, ...]) -> tuple[Any, Any]:
    """This rank's group and its split slice of the stage (``load_tensor_stage``)."""
    from mlxceld.engine.ring import join_ring
    from mlxceld.pipeline.tensor_stage import load_tensor_stage
    from mlxceld.workers.wired import set_wired_limit

    check_split(path, model, len(hosts))
    set_wired_limit()
    group = await unless_stopped(ctx, "ring join", lambda: join_ring(rank, hosts,
                                                                     worker=WORKER))
    log.info("stage %s: tensor-parallel rank %d of %d joined the ring at %s", node_id, rank,
             len(hosts), hosts[rank])
    since = time.time()
    loaded = load_reporter(ctx, since, failpoints.STAGE_LAYER_S)
    stage = await unless_stopped(ctx, "load", lambda: load_tensor_stage(
        path, *layers, group, loaded))
    log.info("stage %s: rank %d loaded %d parameter bytes in %.1f s", node_id, rank,
             stage.nbytes, time.time() - since)
    return group, stage


async def load_leader(ctx: WorkerContext[StageOptions], path: str) -> Any:
    """Rank 0 of a tensor-parallel stage (the ``stage`` worker, its shards fetched at
    ``path``): the ring joined, its slice loaded, and its ``StageLeader`` once every
    follower took the group's setup. ``RuntimeError`` when the daemon gave no ring."""
    from mlxceld.pipeline.tensor_stage import StageLeader

    o = ctx.options
    if len(o.tp_hosts) != o.tp_size:
        raise RuntimeError(f"stage {o.node_id}: tp_size {o.tp_size} and no port on "
                           "127.0.0.1 for each rank's ring (the daemon could bind none)")
    ctx.stats["tensor"] = {"rank": 0, "size": o.tp_size}
    group, stage = await _joined_and_loaded(ctx, path, o.model, o.layers, o.node_id, 0,
                                            o.tp_hosts)
    return await unless_stopped(ctx, "group setup", lambda: StageLeader(
        stage, group, hosts=o.tp_hosts, node_id=o.node_id, worker=WORKER))


def close_group(leader: Any) -> None:
    """Rank 0 stopping: every follower's loop ends (``StageLeader.close``); a group that
    broke meanwhile is only logged (its followers end by their own deadlines)."""
    from mlxceld.engine.base import EngineError

    try:
        leader.close()
    except EngineError as exc:
        log.warning("stage %s: its tensor-parallel group could not be closed: %s",
                    leader.node_id, exc)


async def run(ctx: WorkerContext[StageTensorOptions]) -> int:
    from mlxceld.pipeline.tensor_stage import run_stage_follower

    o = ctx.options
    size = len(o.tp_hosts)
    ctx.stats["tensor"] = {"rank": o.rank, "size": size, "stage": o.node_id}
    path = await _fetched(ctx, o.model, o.layers, o.node_id)
    check_split(path, o.model, size)
    from mlxceld.engine.ring import join_ring
    from mlxceld.workers.wired import set_wired_limit

    set_wired_limit()
    group = await unless_stopped(ctx, "ring join", lambda: join_ring(o.rank, o.tp_hosts,
                                                                     worker=WORKER))
    log.info("stage %s: tensor-parallel rank %d of %d joined the ring at %s", o.node_id,
             o.rank, size, o.tp_hosts[o.rank])
    loop = asyncio.get_running_loop()
    loaded = load_reporter(ctx, time.time(), failpoints.STAGE_LAYER_S)
    followers: list[Any] = []  # the StageFollower, once made on its thread

    def ready() -> None:  # on the follower's thread, once its slice is loaded
        loop.call_soon_threadsafe(_loaded, ctx)

    def counted() -> None:  # before each stats answer
        if followers:
            cache = followers[0].cache
            ctx.stats["tensor"] = {"rank": o.rank, "size": size, "stage": o.node_id,
                                   "steps": followers[0].steps,
                                   "sequences": followers[0].sequences,
                                   "prompt_cache": {"entries": cache.entries,
                                                    "bytes": cache.nbytes}}

    ctx.stats_hooks.append(counted)
    try:  # told to stop: Stopped, its thread left in the ring
        await unless_stopped(ctx, "follower steps", lambda: run_stage_follower(
            path, *o.layers, group, progress=loaded, ready=ready, made=followers.append,
            hosts=o.tp_hosts, worker=WORKER))
    except Stopped:
        raise
    except ConfigError as exc:  # exit 2, not restarted: the same start would fail alike
        raise ConfigError(f"stage {o.node_id} (tensor-parallel rank {o.rank}) failed to "
                          f"load layers [{o.layers[0]}, {o.layers[1]}): {exc.message}",
                          hint=exc.hint) from exc
    except Exception as error:  # the group broke: the supervisor restarts it
        raise RuntimeError(f"stage {o.node_id}: tensor-parallel rank {o.rank} of {size} "
                           f"left the group: {error}") from error
    log.info("stage %s: rank %d: rank 0 closed the group", o.node_id, o.rank)
    return 0


def _loaded(ctx: WorkerContext[StageTensorOptions]) -> None:
    ctx.stats.pop("loading", None)
    ctx.ready()
