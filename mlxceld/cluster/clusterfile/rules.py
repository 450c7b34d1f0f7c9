"""Rules across the nodes of a cluster TOML, and against its model's layer count.

The fields of each node are already checked (``fields``); these rules
look at the nodes together: unique ids and addresses (across every group), one
coordinator, and in each replica group ``pipeline_parallel_size`` stages with ranks
0..N-1 and layer ranges that follow each other in rank order without a gap or an
overlap, so that no layer is ever silently dropped or run twice. A tensor-parallel
group's file holds its ranks alone: ``tensor_parallel_size`` of them, 0..N-1, one each.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxceld.cluster.clusterfile.model import (
    COORDINATOR,
    PIPELINE_STAGE,
    TENSOR_RANK,
    ClusterConfig,
    NodeConfig,
)
from mlxceld.errors import ConfigError
from mlxceld.types import DECODE_ROLE, HYBRID, PREFILL_ROLE, ROUTER_ROLE
from mlxceld.wire.address import parse_address

RANK_HINT = "stages have ranks 0, 1, ..., N-1, one each, in pipeline order"
TENSOR_RANK_HINT = ("the group's N nodes (tensor_parallel_size = N) have ranks 0, 1, ..., N-1, "
                    "one each; rank 0 serves the OpenAI port")


def check_cluster(cfg: ClusterConfig) -> None:
    where = str(cfg.path)
    _unique_ids(cfg.nodes, where)
    _unique_addresses(cfg.nodes, where)
    if cfg.tensor:
        _tensor(cfg, where)
        return
    if cfg.serving:
        _serving(cfg, where)
        return
    _one_coordinator(cfg.nodes, where)
    stages = [n for n in cfg.nodes if n.is_stage]
    if not stages:
        raise ConfigError(f"{where}: no node has role {PIPELINE_STAGE!r}",
                          hint=f'add [[nodes]] tables with role = "{PIPELINE_STAGE}", a rank '
                          "and their layers")
    if cfg.replicas == 1 and cfg.pipeline_parallel_size != len(stages):
        ids = ", ".join(repr(n.id) for n in stages)
        raise ConfigError(
            f"{where}: 'cluster.pipeline_parallel_size' is {cfg.pipeline_parallel_size}, but "
            f"{len(stages)} node(s) have role {PIPELINE_STAGE!r} ({ids})",
            hint=f"set pipeline_parallel_size = {len(stages)}, or add or remove stages")
    for i, group in enumerate(cfg.groups):
        if cfg.replicas > 1 and len(group) != cfg.pipeline_parallel_size:
            ids = ", ".join(repr(n.id) for n in group) or "none"
            raise ConfigError(
                f"{where}: replica {i} has {len(group)} stage(s) ({ids}), but "
                f"'cluster.pipeline_parallel_size' is {cfg.pipeline_parallel_size}: every "
                "replica is a whole pipeline of that many stages",
                hint=f"give replica {i} ranks 0..{cfg.pipeline_parallel_size - 1} (replica = "
                f"{i} on each), or change pipeline_parallel_size or replicas")
        _ranks(group, where)
        _contiguous(group, where)


def _serving(cfg: ClusterConfig, where: str) -> None:
    """A serving cluster: only its four roles; at least one router, each over the file's
    hybrids, or its prefill and decode nodes (both or neither), or all three. Several
    routers serve the same pools (behind a load balancer or DNS)."""
    other = next((n for n in cfg.nodes if not n.is_serving), None)
    if other is not None:
        raise ConfigError(f"{where}: node {other.id!r} has role {other.role!r}, but the file "
                          "has router, hybrid, prefill or decode nodes too: a file describes "
                          "either a pipeline or routers over replicas and pools, not both",
                          hint="write a cluster TOML for each; a hybrid replica that is "
                          "itself a pipeline's coordinator is placed by the pipeline's file")
    if not cfg.with_role(ROUTER_ROLE):
        raise ConfigError(f"{where}: no node has role {ROUTER_ROLE!r}",
                          hint='add a [[nodes]] table with role = "router": it serves the '
                          "OpenAI port over the hybrids (and prefill and decode nodes)")
    prefill, decode = cfg.with_role(PREFILL_ROLE), cfg.with_role(DECODE_ROLE)
    if bool(prefill) != bool(decode):
        have, lack = (PREFILL_ROLE, DECODE_ROLE) if prefill else (DECODE_ROLE, PREFILL_ROLE)
        ids = ", ".join(repr(n.id) for n in (prefill or decode))
        raise ConfigError(f"{where}: the file has {have} node(s) ({ids}) but no {lack} node: "
                          "a router disaggregates over both pools or neither",
                          hint=f'add a [[nodes]] table with role = "{lack}", or remove the '
                          f"{have} nodes")
    if not prefill and not cfg.with_role(HYBRID):
        raise ConfigError(f"{where}: a router needs hybrid nodes (its replicas), or prefill "
                          "and decode nodes, and the file has none",
                          hint='add [[nodes]] tables with role = "hybrid" (or "prefill" and '
                          '"decode")')


def _tensor(cfg: ClusterConfig, where: str) -> None:
    """A tensor-parallel group across hosts: its ranks alone (no stage, coordinator, router,
    hybrid, prefill or decode node), ``tensor_parallel_size`` of them, 0..N-1 one each."""
    other = next((n for n in cfg.nodes if not n.is_tensor_rank), None)
    if other is not None:
        why = ("a pipeline whose stages are tensor-parallel groups is written with role "
               "pipeline_tensor_parallel nodes (the 2D mesh), not beside these"
               if other.role in (COORDINATOR, PIPELINE_STAGE) else
               f"a {other.role} node beside a tensor-parallel group across hosts is not "
               "described by a cluster TOML yet")
        raise ConfigError(f"{where}: node {other.id!r} has role {other.role!r}, but the file "
                          f"has {TENSOR_RANK} nodes too: {why}",
                          hint=f"write a file of {TENSOR_RANK} nodes alone (one group across "
                          "hosts), and the pipeline or the serving cluster in a file of its "
                          "own")
    by_rank: dict[int, NodeConfig] = {}
    for n in cfg.tensor_ranks:
        assert n.rank is not None  # fields requires it
        if n.rank in by_rank:
            raise ConfigError(f"{where}: node {by_rank[n.rank].id!r} and node {n.id!r} both "
                              f"have rank {n.rank}", hint=TENSOR_RANK_HINT)
        by_rank[n.rank] = n
    size = cfg.tensor_parallel_size
    if len(by_rank) != size:
        ids = ", ".join(repr(n.id) for n in cfg.tensor_ranks)
        missing = ", ".join(str(r) for r in range(size) if r not in by_rank)
        raise ConfigError(f"{where}: 'cluster.tensor_parallel_size' is {size}, but "
                          f"{len(by_rank)} node(s) have role {TENSOR_RANK!r} ({ids}); no node "
                          f"has rank {missing}",
                          hint=f"set tensor_parallel_size = {len(by_rank)}, or add a node "
                          "for each rank missing; " + TENSOR_RANK_HINT)


def validate_layers(cfg: ClusterConfig, num_layers: int) -> None:
    """Each group's stages cover the model's ``num_layers`` exactly: no layer missing,
    none extra."""
    for group in cfg.groups:
        _covers(cfg, group, num_layers)


def _covers(cfg: ClusterConfig, stages: Sequence[NodeConfig], num_layers: int) -> None:
    where = str(cfg.path)
    past = next((s for s in stages if _range(s)[1] > num_layers), None)
    if past is not None:
        raise ConfigError(
            f"{where}: {past.describe()} reaches layer {_range(past)[1] - 1}, but the model "
            f"has only {num_layers} layers (0..{num_layers - 1})",
            hint=f"split layers 0..{num_layers - 1} across the stages: the last one ends at "
            f"{num_layers}")
    last = stages[-1]
    start, end = _range(last)
    if end < num_layers:
        raise ConfigError(
            f"{where}: {_span(end, num_layers)} on no stage: the model has {num_layers} "
            f"layers and the last stage, {last.describe()}, ends at {end}",
            hint=f"set layers = [{start}, {num_layers}] on node {last.id!r}, or add a stage")


def _unique_ids(nodes: Sequence[NodeConfig], where: str) -> None:
    seen: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.id in seen:
            raise ConfigError(f"{where}: nodes[{seen[n.id]}] and nodes[{i}] both have id "
                              f"{n.id!r}", hint="node ids must be unique in a cluster")
        seen[n.id] = i


def _unique_addresses(nodes: Sequence[NodeConfig], where: str) -> None:
    seen: dict[tuple[str, int], NodeConfig] = {}
    for n in nodes:
        key = parse_address(n.address).key()
        other = seen.get(key)
        if other is not None:
            spelled = (n.address if n.address == other.address
                       else f"{other.address} and {n.address} are the same")
            raise ConfigError(f"{where}: node {other.id!r} and node {n.id!r} have the same "
                              f"address ({spelled})",
                              hint="give every node its own host:port; nodes on one host "
                              "need different ports")
        seen[key] = n


def _one_coordinator(nodes: Sequence[NodeConfig], where: str) -> None:
    coordinators = [n for n in nodes if n.role == COORDINATOR]
    if not coordinators:
        raise ConfigError(f"{where}: no node has role {COORDINATOR!r}",
                          hint=f'add a [[nodes]] table with role = "{COORDINATOR}": it runs '
                          "the router (the OpenAI port)")
    if len(coordinators) > 1:
        ids = ", ".join(repr(n.id) for n in coordinators)
        raise ConfigError(f"{where}: {len(coordinators)} nodes have role {COORDINATOR!r} "
                          f"({ids}); a cluster has exactly one",
                          hint="keep one coordinator; make the others pipeline stages or "
                          "remove them")


def _ranks(stages: Sequence[NodeConfig], where: str) -> None:
    """The ranks of one group are 0..N-1, one each."""
    by_rank: dict[int, NodeConfig] = {}
    for n in stages:
        assert n.rank is not None
        other = by_rank.get(n.rank)
        if other is not None:
            raise ConfigError(f"{where}: node {other.id!r} and node {n.id!r} both have rank "
                              f"{n.rank}", hint=RANK_HINT)
        by_rank[n.rank] = n
    missing = sorted(set(range(len(stages))) - set(by_rank))
    if missing:
        ranks = ", ".join(str(r) for r in sorted(by_rank))
        group = f" of replica {stages[0].replica}" if stages[0].replica else ""
        raise ConfigError(f"{where}: no stage{group} has rank {missing[0]}: the ranks of "
                          f"{len(stages)} stages are 0 to {len(stages) - 1}, not {ranks}",
                          hint=RANK_HINT)


def _contiguous(stages: Sequence[NodeConfig], where: str) -> None:
    """In rank order, rank 0 starts at layer 0 and each stage where the one before ended."""
    end = 0
    for i, s in enumerate(stages):
        start, stop = _range(s)
        if start > end and i == 0:
            raise ConfigError(f"{where}: {_span(0, start)} on no stage: {s.describe()} is "
                              f"the first stage and starts at {start}",
                              hint=f"rank 0 starts at layer 0: layers = [0, {stop}]")
        if start > end:
            raise ConfigError(f"{where}: {_span(end, start)} on no stage: "
                              f"{stages[i - 1].describe()} ends at {end} and "
                              f"{s.describe()} starts at {start}",
                              hint="each stage starts where the stage of the rank before it "
                              f"ends (layer {end} here)")
        if start < end:
            other = next(o for o in stages[:i] if _range(o)[0] <= start < _range(o)[1])
            raise ConfigError(f"{where}: {_span(start, min(stop, _range(other)[1]))} on both "
                              f"{other.describe()} and {s.describe()}",
                              hint="each stage starts where the stage of the rank before it "
                              f"ends (layer {end} here)")
        end = stop


def _range(node: NodeConfig) -> tuple[int, int]:
    assert node.layers is not None, f"stage {node.id!r} without layers"
    return node.layers


def _span(start: int, end: int) -> str:
    """Layers [start, end) for a message, with its verb."""
    return f"layer {start} is" if end - start == 1 else f"layers {start}..{end - 1} are"
