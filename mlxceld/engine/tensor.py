"""Tensor parallelism inside one host: the model's layers split over the ranks of an
``mlx.distributed`` group, driven by rank 0's engine.

Every rank loads the model lazily, lets mlx-lm split it (``model.shard(group)``: each
attention and MLP projection sharded by heads or rows, their outputs summed over the
group), and then reads only its own slices. A rank holds about 1/N of the layers'
weights, plus the embedding and the head, which stay whole.

Rank 0 is a ``LocalEngine`` with a ``Mirror``; ranks 1..N-1 run ``run_tensor_follower``.
Every rank has its own mlx-lm ``BatchGenerator`` and prompt cache, and all of them must
take the same batch steps in the same order, since each step's collectives pair up
across the ranks. So, on rank 0's step thread, before each step:

- rank 0 shares its *op log* since the last step with the followers: each sequence
  inserted (its prompt tokens, ``max_tokens``, how many prompt tokens its prompt cache
  spared, whether it samples greedily) and each removed (cancelled). The log is pickled
  and sent with two ``all_sum``s (its size, then its bytes), as mlx-lm's own server does.
  The followers apply the same ops to their generators, so that the ranks' batches,
  uids and prompt caches stay equal; a follower whose prompt cache would spare another
  count than rank 0's, or whose generator hands out another uid, stops with an
  ``EngineError`` (a bug, never an input: the group restarts).
- every rank then runs ``BatchGenerator.next()``. The model's collectives make the
  logits the same on every rank. Rank 0 alone applies the requests' logits processors,
  constraints and samplers; its sampled tokens go to the followers with one ``all_sum``
  per sampler call (followers add zeros), so every rank feeds the same tokens into the
  next step and ends each sequence on the same step. The sampler calls are made in the
  same pattern on every rank: one call for a batch whose sequences all sample greedily,
  else one per row (see ``Mirror.sampler``), and each call's ``all_sum`` is chained to
  the previous one, so the ranks' collectives are queued in one order.

While rank 0 has no sequence it shares an empty op log every ``engine.local.IDLE_WAIT_S``
(0.5 s): a heartbeat, through which a rank that died is seen (mlx raises ``RuntimeError:
[ring] connection to a peer was lost`` from the next collective) and the engine fails,
so its worker exits and the daemon restarts the group. When rank 0 closes, it shares
``close`` and every follower returns.

Not under tensor parallelism: the KV handoff of prefill/decode disaggregation
(``LocalEngine.prefill`` and ``generate_from`` refuse).

Ring (``join_ring``): ``MLX_RANK`` and ``MLX_HOSTFILE`` name this rank and a JSON file of
every rank's ``host:port``, written 0600 in a private temporary directory and removed
once the ring is joined. mlx's ``init`` waits for every rank without a deadline; here it
gets ``RING_DEADLINE_S``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import mlx.core as mx
import numpy as np

from mlxceld.engine.base import EngineError
from mlxceld.engine.sampling import Sampler, greedy
from mlxceld.models.reading import Progress, model_layers, read_weights

log = logging.getLogger(__name__)

RING_DEADLINE_S: Final = 60.0  # join_ring: for every rank to join (they load first)
BACKEND: Final = "ring"  # TCP sockets: loopback on Linux; Macs could use "jaccl" later

# An op of the log: ("insert", uid, tokens, max_tokens, spared, greedy), ("remove", uid),
# ("close",).
Op = tuple[Any, ...]


def join_ring(rank: int, hosts: Sequence[str], *, deadline_s: float = RING_DEADLINE_S
              ) -> Any:
    """Join the ``mx.distributed`` ring of ``len(hosts)`` ranks as ``rank``; ``hosts``:
    each rank's ``host:port``, rank 0 first. Raises ``EngineError`` when the others have
    not all joined within ``deadline_s`` (the waiting thread is left behind: the caller
    exits)."""
    if not 0 <= rank < len(hosts) or len(hosts) < 2:
        raise ValueError(f"rank {rank} of {len(hosts)} ranks: a ring needs at least 2 "
                         "ranks and a rank among them")
    done: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mlxceld-ring-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        fd = os.open(hostfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump([[h] for h in hosts], f)
        os.environ["MLX_RANK"] = str(rank)
        os.environ["MLX_HOSTFILE"] = str(hostfile)

        def init() -> None:
            try:
                done["group"] = mx.distributed.init(strict=True, backend=BACKEND)
            except BaseException as exc:  # reported to the joining thread below
                done["error"] = exc

        thread = threading.Thread(target=init, name="mlxceld-ring-join", daemon=True)
        thread.start()
        thread.join(deadline_s)
        for name in ("MLX_RANK", "MLX_HOSTFILE"):
            os.environ.pop(name, None)
    if "error" in done:
        raise EngineError(f"rank {rank} could not join the tensor-parallel ring at "
                          f"{hosts[rank]}: {done['error']}")
    if "group" not in done:
        others = ", ".join(f"rank {r} ({h})" for r, h in enumerate(hosts) if r != rank)
        raise EngineError(f"rank {rank} waited {deadline_s:g} s for the other ranks of the "
                          f"tensor-parallel ring and not all came: {others}; each is a "
                          "worker of this daemon (mlxctl workers; mlxctl logs tp-1)")
    group = done["group"]
    if group.size() != len(hosts) or group.rank() != rank:
        raise EngineError(f"the ring says rank {group.rank()} of {group.size()}; this "
                          f"worker is rank {rank} of {len(hosts)}")
    return group


def load_shard(path: str, group: Any, progress: Progress | None = None
               ) -> tuple[Any, dict[str, Any]]:
    """The model at ``path`` split over ``group`` (mlx-lm's ``shard``), with only this
    rank's slices read; and its config. Every rank of the group must call it."""
    from mlx_lm.utils import load_model

    model, config = load_model(Path(path), lazy=True)
    if not hasattr(model, "shard"):
        raise EngineError(f"mlx-lm has no tensor-parallel split for model type "
                          f"{config.get('model_type')!r} ({path}); serve it with tp_size 1")
    model.shard(group)
    read_weights(model_layers(model), model, progress)
    barrier(group)
    return model, config


def barrier(group: Any) -> None:
    """Return once every rank of ``group`` has come here."""
    mx.eval(mx.distributed.all_sum(mx.array([1], dtype=mx.int32), group=group,
                                   stream=mx.cpu))


class Mirror:
    """One rank's side of the op log and of the sampled tokens (the module docstring)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank: int = group.rank()
        self.size: int = group.size()
        # The last token share (the chain); made on the step thread, where its stream is.
        self._last: mx.array | None = None
        self._greedy: Sampler = self._lead(greedy) if self.leader else self._follow()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, ops: list[Op]) -> list[Op]:
        """Rank 0: send ``ops``; a follower: receive rank 0's (its own ``ops`` unused).
        Call on the generator's stream (``with mx.stream(gen.stream)``), so that it is
        queued after the last step's token shares."""
        g = self.group
        if self.leader:
            data = pickle.dumps(ops) if ops else b""
            mx.eval(mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=g))
            if data:
                mx.eval(mx.distributed.all_sum(mx.array(np.frombuffer(data, dtype=np.uint8)),
                                               group=g))
            return ops
        size = np.array(mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32), group=g))
        if int(size[0]) == 0:
            return []
        got = mx.distributed.all_sum(mx.zeros((int(size[0]),), dtype=mx.uint8), group=g)
        shared: list[Op] = pickle.loads(np.array(got).tobytes())  # rank 0's, in the ring
        return shared

    def sampler(self, own: Sampler | None) -> tuple[Sampler, bool]:
        """A sequence's sampler on this rank, and whether it is the shared greedy one.
        Rank 0: ``own`` (the request's), its tokens shared; the shared ``greedy`` becomes
        one shared sampler, so a batch of greedy sequences samples in one call as on one
        process. A follower (``own`` None): takes rank 0's tokens; pass ``follower_greedy``
        (the op's flag) to ``follower`` instead."""
        if own is greedy:
            return self._greedy, True
        assert own is not None and self.leader
        return self._lead(own), False

    def follower(self, shared_greedy: bool) -> Sampler:
        """A follower's sampler for a sequence rank 0 samples with ``sampler``: the one
        shared receiver for greedy ones, else a receiver of its own (so that the
        follower's generator calls samplers in rank 0's pattern)."""
        return self._greedy if shared_greedy else self._follow()

    def _lead(self, own: Sampler) -> Sampler:
        def lead(logprobs: mx.array) -> mx.array:
            return self._chained(own(logprobs).astype(mx.int32))
        return lead

    def _follow(self) -> Sampler:
        def follow(logprobs: mx.array) -> mx.array:
            # Zeros that depend on the logits: queued after this step's model collectives.
            return self._chained((mx.argmax(logprobs, axis=-1) * 0).astype(mx.int32))
        return follow

    def _chained(self, tokens: mx.array) -> mx.array:
        """``tokens`` summed over the group (rank 0's, plus the followers' zeros), after
        the previous share (a data dependency: the collectives stay in one order)."""
        after = tokens if self._last is None \
            else tokens + (self._last.sum() * 0).astype(mx.int32)
        self._last = mx.distributed.all_sum(after, group=self.group)
        return self._last


def run_tensor_follower(path: str, group: Any, *, max_batch: int = 8,
                        progress: Progress | None = None,
                        ready: Callable[[], None] | None = None) -> None:
    """Rank ``group.rank()`` (≥ 1) of a tensor-parallel engine: load this rank's slices
    of ``path``, say ``ready()``, then take rank 0's steps until it closes the group.
    Raises ``EngineError`` when the ring breaks (rank 0 or another rank gone)."""
    from mlxceld.engine.local import Follower

    model, _ = load_shard(path, group, progress)
    follower = Follower(model, Mirror(group), max_batch=max_batch)
    if ready is not None:
        ready()
    try:
        follower.run()
    except RuntimeError as exc:  # mlx's: "[ring] connection to a peer was lost"
        raise EngineError(f"tensor-parallel rank {group.rank()} lost the ring: {exc}") from exc


def load_tensor_engine(path: str, group: Any, *, model_id: str | None = None,
                       max_batch: int = 8,
                       on_failure: Callable[[BaseException], None] | None = None,
                       progress: Progress | None = None) -> tuple[Any, Any]:
    """Rank 0 of a tensor-parallel engine: ``engine.local.load_local_engine``'s engine and
    tokenizer, with the model split over ``group``; the engine drives the followers."""
    from mlx_lm.utils import load_tokenizer

    from mlxceld.engine.local import engine_for

    model, config = load_shard(path, group, progress)
    tokenizer = load_tokenizer(Path(path),  # type: ignore[no-untyped-call]
                               eos_token_ids=config.get("eos_token_id", None))
    engine = engine_for(model, tokenizer, config, model_id=model_id or Path(path).name,
                        max_batch=max_batch, on_failure=on_failure, mirror=Mirror(group))
    return engine, tokenizer

