"""A stage's place in its cluster, the sequences it holds, and the work queued for them
(``stage.py`` serves them; ``compute.py`` runs the steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxceld.engine.base import SamplingParams
from mlxceld.net import MxclStream
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.compute import SeqState, StageModelLike, Step
from mlxceld.roles.options import KVQuant


@dataclass(frozen=True)
class StagePlace:
    """Where this stage sits in its cluster (from the cluster config)."""

    node_id: str
    rank: int
    layers: tuple[int, int]
    address: str  # our own listener address: the identity we dial downstream with
    coordinator: str  # the coordinator's address: commands come only from it
    upstream: str | None  # the previous stage's address (None on the first stage)
    downstream: tuple[str, int] | None  # the next stage's listener (None on the last)
    model_identity: str
    cluster: str
    first: tuple[str, int] | None  # on the last of 2+ stages: the first stage's listener
    last: str | None  # on the first of 2+ stages: the last stage's address (sends ``next``)


@dataclass
class StageSequence:
    """A sequence prepared on this stage: who owns it, where its answers go, its state."""

    owner: str  # the bound identity that prepared it
    stream: MxclStream  # the owner's connection: replies go there
    state: SeqState  # its caches and sampler, used on the compute thread
    params: SamplingParams
    eos: frozenset[int] = frozenset()  # the last stage stops the sequence at one of these
    next_step: int = 0
    produced: int = 0  # tokens sampled (on the last stage)
    token_base: int = 0  # the first sampling step's number: the first token's (protocol.py)
    snapshot: str | None = None  # keep_prompt: the entry its prefilled prompt is kept as


@dataclass(frozen=True)
class Keep:
    """A released sequence's caches to keep as a prompt-cache entry (``release`` with
    ``keep``): done between steps, after any step of it still running."""

    seq_id: str
    seq: StageSequence
    entry: str
    tokens: int


@dataclass
class Work(Step):
    """A step of a sequence, queued for the compute."""

    seq: StageSequence


@dataclass
class StageStats:
    """A stage's counts, for its worker's stats and the supervisor's watchdog."""

    steps: int = 0  # forward passes (a batch is one)
    tokens: int = 0
    refused: int = 0
    compute_s: float = 0.0  # time in the stage's layers
    inline: int = 0  # steps run on the event loop's thread (short decode steps)
    last_step_at: float | None = None  # time.monotonic() when the last step ended


def stage_cache(model: StageModelLike, kv: KVQuant | None, node_id: str) -> list[Any]:
    """A new sequence's cache of the stage's layers: each layer's own kind, or with ``kv``
    (the ``prepare``'s) quantizing (``engine/kvquant.py``); a layer whose kind cannot be
    quantized refuses the ``prepare`` (the router refuses such a family at its start)."""
    caches = model.make_cache()
    if kv is None:
        return caches
    from mlxceld.engine.kvquant import quantizing  # mlx: only once serving

    try:
        return list(quantizing(caches, kv))
    except ValueError as exc:
        raise p.ProtocolViolation(p.ERR_BAD_MESSAGE, f"'kv': stage {node_id} cannot keep a "
                                  f"quantized KV cache: its {exc}") from None
