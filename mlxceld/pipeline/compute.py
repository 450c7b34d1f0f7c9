"""A stage's compute: which queued steps run together, and running them.

Steps that wait in a stage's queue at the same moment are grouped: the first
one-token step (a decode step) of each of up to ``MAX_BATCH`` sequences runs as
one batch through the stage's layers, their KV caches merged for the step
(mlx-lm's batch caches, left-padded) and split again after it. Everything else
(prefill chunks, a second step of a sequence already in the batch) runs alone
afterwards, in arrival order, so each sequence's steps keep their order.

Batching is what lets a stage serve several sequences for little more than the
price of one on a machine whose step time is dominated by reading the weights.

Runs on the stage's compute thread only: mlx arrays belong to the thread (its
stream) that made them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from mlxceld.wire import Tensor
from mlxceld.wire.mx_tensors import blob_of, from_blob, wire_bits

MAX_BATCH: Final = 16


class StageModelLike(Protocol):
    """What the compute needs of the stage's model slice (``models.slicing.StageModel``)."""

    first: bool
    last: bool
    hidden_size: int
    vocab_size: int

    def make_cache(self) -> list[Any]: ...

    def forward(self, x: Any, cache: list[Any], *, evaluate: bool = True) -> Any: ...


@dataclass
class SeqState:
    cache: list[Any]  # one mlx-lm cache per own layer
    sampler: Callable[[Any], Any] | None  # the last stage's, with the request's parameters


@dataclass
class Step:
    seq_id: str
    state: SeqState
    step: int
    sample: bool
    x: Tensor  # token ids [1, n] or hidden states [1, n, H], checked, a view of the message

    @property
    def tokens(self) -> int:
        return self.x.shape[1]


def plan(steps: Sequence[Step]) -> list[list[Step]]:
    """Groups to run in order: one batch of first-in-line decode steps, then the rest
    one by one in arrival order."""
    batch: list[Step] = []
    rest: list[Step] = []
    seen: set[str] = set()
    for s in steps:
        if s.tokens == 1 and s.seq_id not in seen and len(batch) < MAX_BATCH:
            batch.append(s)
        else:
            rest.append(s)
        seen.add(s.seq_id)
    groups = [batch] if batch else []
    return groups + [[s] for s in rest]


def run_group(model: StageModelLike, group: Sequence[Step]) -> list[Any]:
    """Run ``group`` (one step per sequence); per step: a hidden-state blob for the next
    stage, or on the last stage the sampled token id (``None`` where not sampled).

    One evaluation per step: the layers, the caches' updates and what leaves the stage
    (the wire bytes, or the sampled ids) are evaluated together, so the compute
    thread waits for mlx once, not once per array."""
    import mlx.core as mx

    if model.first:
        check_token_ids(group, model.vocab_size)
    xs = [from_blob(s.x) for s in group]
    x = xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=0)
    also: list[Any] = []  # the split caches of a batch
    if len(group) == 1:
        out = model.forward(x, group[0].state.cache, evaluate=False)
    else:
        layers = len(group[0].state.cache)
        merged = [group[0].state.cache[i].merge([s.state.cache[i] for s in group])
                  for i in range(layers)]
        out = model.forward(x, merged, evaluate=False)
        for j, s in enumerate(group):
            s.state.cache = [c.extract(j) for c in merged]
        also = [(c.keys, c.values) for s in group for c in s.state.cache]
    if not model.last:
        parts = [out[j:j + 1] for j in range(len(group))]
        raws = [wire_bits("hidden", part) for part in parts]
        mx.eval(raws, also)
        return [blob_of("hidden", part, raw) for part, raw in zip(parts, raws, strict=True)]
    picks: list[Any] = []
    for j, s in enumerate(group):
        assert s.state.sampler is not None or not s.sample
        picks.append(s.state.sampler(out[j:j + 1]) if s.sample and s.state.sampler else None)
    mx.eval([p for p in picks if p is not None], out, also)
    return [None if p is None else int(p.item()) for p in picks]


def check_token_ids(group: Sequence[Step], vocab_size: int) -> None:
    """Every token id of ``group`` in [0, vocab_size), checked on the wire bytes (the
    blobs are i32, checked by the envelope's spec) before mlx sees them."""
    for s in group:
        ids = s.x.data.cast("B").cast("i")
        low, high = min(ids), max(ids)
        if not 0 <= low <= high < vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}); got {low}..{high}")
