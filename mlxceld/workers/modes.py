"""The router worker's engine modes: one frozen record per mode, read off its options.

The bootstrap pipe carries ``RouterOptions`` (``roles/options.py``), whose optional
fields say where the engine is; ``engine_mode`` reads them once, at the edge, into one
of the records below (a tagged union: ``EngineMode``), which ``workers/engines.py``'s
``make_engine`` matches on.

    LocalMode       the model in this process (``tp_size`` 1)
    TensorMode      the model on this host's tensor-parallel ranks, the router rank 0
    PipelineMode    remote pipeline stages (``pipeline``)
    GroupsMode      replica groups: several pipelines, one pool (``replica_pipelines``)
    ReplicasMode    a router node's replicas, listed (``replicas.agents``)
    DiscoveredMode  a router node's replicas, found by discovery (``replicas.discover``)
    DisaggMode      a router node's prefill and decode nodes (``replicas.prefill_agents``),
                    its listed replicas, if any, the fallback
    HandoffMode     a prefill or decode node: the model here, no OpenAI port (``handoff``)

Tensor parallelism with anything but a local model is refused (``ConfigError``: exit 2,
naming the option), as is a ring whose ports the daemon could not pick.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxceld.errors import ConfigError
from mlxceld.roles.options import (
    HandoffOptions,
    PipelineOptions,
    ReplicasOptions,
    RouterOptions,
)


@dataclass(frozen=True)
class LocalMode:
    """The whole model in this process."""


@dataclass(frozen=True)
class TensorMode:
    """The model split over ``size`` ranks on this host (``hosts``: the ring, rank 0
    first: this router)."""

    size: int
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class PipelineMode:
    """Remote stages; only the tokenizer here."""

    pipeline: PipelineOptions


@dataclass(frozen=True)
class GroupsMode:
    """Replica groups: each group a pipeline of its own, the groups one pool."""

    groups: tuple[PipelineOptions, ...]


@dataclass(frozen=True)
class ReplicasMode:
    """A router node over its listed replicas."""

    replicas: ReplicasOptions


@dataclass(frozen=True)
class DiscoveredMode:
    """A router node whose replicas discovery finds (it starts with none)."""

    replicas: ReplicasOptions


@dataclass(frozen=True)
class DisaggMode:
    """A router node over prefill and decode nodes (and its listed replicas, if any, as
    the fallback)."""

    replicas: ReplicasOptions


@dataclass(frozen=True)
class HandoffMode:
    """A prefill or decode node: the model here, served on the serving listener only."""

    handoff: HandoffOptions


EngineMode = (LocalMode | TensorMode | PipelineMode | GroupsMode | ReplicasMode
              | DiscoveredMode | DisaggMode | HandoffMode)


def engine_mode(o: RouterOptions) -> EngineMode:
    """The mode ``o`` asks for (``ConfigError`` for tensor parallelism where it is not
    built)."""
    check_tensor_options(o)
    if o.handoff is not None:
        return HandoffMode(o.handoff)
    if o.replicas is not None:
        r = o.replicas
        if r.discover:
            return DiscoveredMode(r)
        return DisaggMode(r) if r.prefill_agents else ReplicasMode(r)
    if o.pipeline is not None:
        if o.replica_pipelines:
            return GroupsMode((o.pipeline, *o.replica_pipelines))
        return PipelineMode(o.pipeline)
    if o.tp_size > 1:
        return TensorMode(o.tp_size, o.tp_hosts)
    return LocalMode()


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
