"""The ``tp`` role: one rank >= 1 of a router's tensor-parallel group (issue 20).

Options (``TensorOptions``, from ``[serve] tp_size``: ``daemon/roster.py``): model, model_name,
rank, tp_hosts (the ring: ``host:port`` per rank, rank 0 the router), max_batch (the
router's: every rank's ``BatchGenerator`` must be built alike). No cluster secret, no
API key, no port of its own besides its ring's.

Start-up: a model named by its Hugging Face repo id is fetched first (``downloading``
in its stats, as the router's); the model is checked for the split
(``models.tensor.check_model_dir``: a family mlx-lm cannot shard, or a ``tp_size`` that
does not divide its heads, is refused as ``ConfigError``: exit 2, not restarted); then
it joins the ring (``engine.tensor.join_ring``: mlx 0.32's ``mx.distributed.init``
holds the GIL while it waits for a peer, so meanwhile the worker answers no probe and
takes no SIGTERM; its deadline, ``RING_DEADLINE_S`` (60 s), is kept by faulthandler's
watchdog thread, which needs no GIL: past it the process exits with status 1, its log
naming the ranks it waited for; the group rule's SIGKILL ends it sooner when a peer
exits or fails, ``supervisor/groups.py``), and follows rank
0 in a thread (``engine.tensor.run_tensor_follower``: reads its slice of the weights,
with ``loading`` in its stats as the router's, reports ready, then runs each step rank 0
shares) while the worker's loop keeps answering health probes and stats
(``tensor``: its rank and the group's size; once it follows, the batch steps it took
and the sequences in its batch).

It ends when rank 0 closes the group (exit 0), when the ring breaks (a peer died: it
exits non-zero, the log line naming why; the supervisor then restarts the whole group:
``supervisor/groups.py``), or when told to stop (exit 0: its thread, blocked in the
ring, is left to the process's end).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from mlxceld.errors import ConfigError
from mlxceld.models.tensor import TensorParallelRefused, check_model_dir
from mlxceld.roles.options import TensorOptions
from mlxceld.workers.runtime import (
    Stopped,
    WorkerContext,
    fetched_path,
    load_reporter,
    unless_stopped,
)

log = logging.getLogger(__name__)


def check_split(path: str, model: str, tp_size: int) -> None:
    """``models.tensor.check_model_dir`` as ``ConfigError`` (exit 2, not restarted): the
    same start would be refused the same way. Shared with the router (rank 0)."""
    try:
        check_model_dir(Path(path), tp_size)
    except TensorParallelRefused as exc:
        raise ConfigError(f"tensor parallelism over {tp_size} ranks refused: {exc}",
                          hint="set [serve] tp_size (--tp-size) to a size the model allows, "
                          "or 1") from None
    except FileNotFoundError:
        raise ConfigError(f"model {model!r} has no config.json at {path}",
                          hint="point [serve] model at an mlx-lm model directory") from None


async def join_group(ctx: WorkerContext[Any], rank: int, hosts: tuple[str, ...]) -> Any:
    """This rank's ``mx.distributed`` group: ``engine.tensor.join_ring`` on a thread of
    its own (its deadline, ``RING_DEADLINE_S``, ends the process: the module
    docstring)."""
    from mlxceld.engine.tensor import join_ring

    return await unless_stopped(ctx, "ring join", lambda: join_ring(rank, hosts))


async def run(ctx: WorkerContext[TensorOptions]) -> int:
    o = ctx.options
    size = len(o.tp_hosts)
    ctx.stats["tensor"] = {"rank": o.rank, "size": size}
    path = await fetched_path(ctx, o.model)
    check_split(path, o.model, size)
    from mlxceld.engine.tensor import run_tensor_follower
    from mlxceld.workers.wired import set_wired_limit

    set_wired_limit()
    group = await join_group(ctx, o.rank, o.tp_hosts)  # told to stop first: Stopped
    log.info("tp rank %d of %d joined the ring at %s", o.rank, size, o.tp_hosts[o.rank])
    loop = asyncio.get_running_loop()
    loaded = load_reporter(ctx, time.time())

    def ready() -> None:  # on the follower's thread, once its slice is loaded
        loop.call_soon_threadsafe(_loaded, ctx)

    followers: list[Any] = []  # the Follower, once made on its thread

    def counted() -> None:  # before each stats answer
        if followers:
            ctx.stats["tensor"] = {"rank": o.rank, "size": size, "steps": followers[0].steps,
                                   "sequences": followers[0].sequences}

    ctx.stats_hooks.append(counted)
    try:  # told to stop: Stopped, its thread left in the ring
        await unless_stopped(ctx, "follower steps", lambda: run_tensor_follower(
            path, group, max_batch=o.max_batch, progress=loaded, ready=ready,
            made=followers.append, hosts=o.tp_hosts))
    except Stopped:
        raise
    except Exception as error:  # the ring broke: the supervisor restarts the group
        raise RuntimeError(f"tp rank {o.rank} of {size} left the group: {error}") from error
    log.info("tp rank %d: rank 0 closed the group", o.rank)
    return 0


def _loaded(ctx: WorkerContext[TensorOptions]) -> None:
    ctx.stats.pop("loading", None)
    ctx.ready()
