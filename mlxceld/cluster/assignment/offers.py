"""Stage offers of the two-phase assignment (channel 2) and how a peer judges one.

An offer (``wire/assignment_messages.py``'s ``Offer``) tells a peer which stage of which
plan it is to run. The peer checks, in this order, and refuses at the first problem:

1. the assignment protocol version (``ASSIGNMENT_VERSION``)     final
2. the package version (both ends run the same release)         final
3. the cluster name                                             back to waiting
4. the model identity (its own checkpoint's)                    final
   the model family: its checkpoint's ``model_type`` is one
   mlxceld splits into stages (``models.families``)             final
5. the cluster TOML in the offer (parsed and checked)           back to waiting
6. the layer range: the TOML must cover exactly the layers of
   the peer's own checkpoint, and its stage there must have
   the offered range                                            final
7. the node id: ``stage-<index>``, the node of that index      back to waiting
   (the offer's ``stage`` is the stage's index in the TOML's
   stages, group by group with replicas: its rank with one)
8. the stage port: inside this peer's ``stage_ports`` range,
   when it has one (``stage_ports.py``)                         back to waiting
   the listener: the TOML places this peer's stage at the
   offered port, one it proposed, on a host that is this peer   back to waiting
9. the coordinator: the TOML's coordinator and the offer's
   coordinator are the identity the handshake bound             back to waiting

A 2D mesh's TOML (``pipeline_tensor_parallel`` nodes) comes with the offer's group
(``tp_rank``, ``tp_group``: its stage's ranks' agents in rank order), and a group comes
only with a mesh's TOML (``tensor_group``, back to waiting): its size is the TOML's
``tensor_parallel_size``, its ranks past 0 the agents the TOML gives the offered stage's
ranks, and its rank 0 on the host of the stage's listener. Rank 0 is then judged as a
stage (6 to 9); a rank past 0 (``stage-K-tp-R``, port 0) has no listener: its node is the
TOML's rank R of stage K, with the offered layers, at an agent address of this peer
(``listener``), and its coordinator as 9.

"This peer" (8): the stage's host is the agent's IP when the agent listens on
one IP; any address of this host (one the kernel lets us bind: each interface's,
the one the coordinator reached us on) when it listens on a wildcard; an
address of the agent's host name when it listens on a name. A host name in the
TOML is looked up (8 and 9: ``mlxceld.net.resolve``), so ``judge`` blocks: run
it in a thread, under a deadline.

and before all of them, the epoch: an offer from a plan not newer than the
newest the peer has seen is refused (stale). A *final* refusal ends the peer's wait
("stage assignment refused": a retry against the same coordinator cannot
succeed); any other sends it back to waiting for a better offer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from mlxceld.cluster.clusterfile.load import ClusterConfig, parse_cluster_text, validate_layers
from mlxceld.cluster.clusterfile.model import NodeConfig
from mlxceld.config.stage_ports import StagePorts
from mlxceld.errors import ConfigError
from mlxceld.models.families import family_problem
from mlxceld.net.resolve import ResolveError, is_local_ip, matches_blocking, resolve_blocking
from mlxceld.wire.address import HostPort, canonical_address, ip_or_none, parse_address
from mlxceld.wire.assignment_messages import Offer

ASSIGNMENT_VERSION: Final = 2


@dataclass(frozen=True)
class Refusal:
    code: str
    reason: str
    final: bool  # True: the peer stops waiting ("stage assignment refused")


@dataclass(frozen=True)
class PeerFacts:
    """What a peer knows of itself to judge an offer."""

    package_version: str
    cluster: str
    model_identity: str | None  # None: no model here
    num_layers: int | None
    agent_host: str
    ports: frozenset[int]  # the stage listener ports it proposed
    stage_ports: StagePorts | None = None  # the range its stage ports must be in, if any
    # its checkpoint's family (config.json's model_type; None: none there, or no model)
    model_family: str | None = None


def judge(offer: Offer, me: PeerFacts, *, bound_identity: HostPort, newest_epoch: int,
          toml_path: Path) -> ClusterConfig | Refusal:
    """The cluster config to run if the offer is good, else the first refusal."""
    if offer.epoch <= newest_epoch:
        return Refusal("stale_epoch", f"plan epoch {offer.epoch} is not newer than epoch "
                       f"{newest_epoch}, the newest this node has seen", False)
    if offer.assignment_version != ASSIGNMENT_VERSION:
        return Refusal("assignment_version", "assignment protocol mismatch: the coordinator "
                       f"speaks version {offer.assignment_version}, this node "
                       f"{ASSIGNMENT_VERSION}", True)
    if offer.package_version != me.package_version:
        return Refusal("package_version", f"the coordinator runs mlxceld "
                       f"{offer.package_version}, this node {me.package_version}", True)
    if offer.cluster != me.cluster:
        return Refusal("cluster_name", f"the offer is for cluster {offer.cluster!r}, this "
                       f"node is in cluster {me.cluster!r}", False)
    if me.model_identity is None or offer.model_identity != me.model_identity:
        return Refusal("model", f"the offer is for model {offer.model_identity}, this node "
                       f"has {me.model_identity or 'no model'}", True)
    problem = family_problem(me.model_family, "this node's config.json")
    if problem is not None:
        return Refusal("model_family", problem, True)
    try:
        cfg = parse_cluster_text(offer.toml, toml_path)
    except ConfigError as exc:
        return Refusal("cluster_toml", f"the offered cluster TOML is not valid: {exc.message}",
                       False)
    return _judge_placement(offer, me, cfg, bound_identity)


def _judge_placement(offer: Offer, me: PeerFacts, cfg: ClusterConfig,
                     bound_identity: HostPort) -> ClusterConfig | Refusal:
    stages = cfg.stages
    if not 0 <= offer.stage < len(stages):
        return Refusal("layer_range", f"the offered cluster has no stage {offer.stage}", True)
    node = stages[offer.stage]
    try:
        assert me.num_layers is not None
        validate_layers(cfg, me.num_layers)
    except ConfigError as exc:
        return Refusal("layer_range", f"the offered split does not fit this node's checkpoint "
                       f"({me.num_layers} layers): {exc.message}", True)
    if node.layers != offer.layers:
        return Refusal("layer_range", f"the offer says layers {list(offer.layers)}, its "
                       f"cluster TOML gives stage {offer.stage} layers "
                       f"{list(node.layers or ())}", True)
    group = _judge_group(offer, cfg, node)
    if group is not None:
        return group
    if offer.tp_rank > 0:
        return _judge_rank(offer, me, cfg, bound_identity)
    if offer.node_id != f"stage-{offer.stage}" or node.id != offer.node_id:
        return Refusal("node_id", f"the offer names node {offer.node_id!r} for stage "
                       f"{offer.stage}; expected 'stage-{offer.stage}' in the TOML too", False)
    if me.stage_ports is not None and offer.port not in me.stage_ports:
        return Refusal("stage_port", f"the offer places stage {offer.stage} at port "
                       f"{offer.port}, outside this node's stage_ports {me.stage_ports}",
                       False)
    where = parse_address(node.address)
    if where.port != offer.port or where.port not in me.ports \
            or not _is_mine(where.host, me.agent_host):
        return Refusal("listener", f"the offer places stage {offer.stage} at {node.address}; "
                       f"this node's agent listens on {me.agent_host} and it proposed ports "
                       f"{sorted(me.ports)}", False)
    return _from_coordinator(offer, cfg, bound_identity) or cfg


def _from_coordinator(offer: Offer, cfg: ClusterConfig,
                      bound_identity: HostPort) -> Refusal | None:
    """A refusal unless the offer, and its TOML, name the coordinator it came from."""
    if matches_blocking(cfg.coordinator.address, bound_identity) \
            and matches_blocking(offer.coordinator, bound_identity):
        return None
    return Refusal("coordinator", f"the offer names coordinator {offer.coordinator} "
                   f"(TOML: {cfg.coordinator.address}), but it came from {bound_identity}",
                   False)


def _judge_group(offer: Offer, cfg: ClusterConfig, stage: NodeConfig) -> Refusal | None:
    """The offer's group against the mesh's TOML (the module docstring), or None."""
    if not cfg.mesh and not offer.tp_group:
        return None
    if not cfg.mesh or not offer.tp_group:
        said = ("a tensor group but a TOML of no 2D mesh" if offer.tp_group
                else "no tensor group for a 2D mesh's stage")
        return Refusal("tensor_group", f"the offer carries {said}", False)
    ranks = cfg.stage_ranks(stage.id)
    agents = tuple(n.address for n in ranks[1:])
    if (len(offer.tp_group) != cfg.tensor_parallel_size
            or tuple(offer.tp_group[1:]) != agents
            or not _same_host(offer.tp_group[0], stage.address)):
        return Refusal("tensor_group", f"the offer's group {list(offer.tp_group)} is not stage "
                       f"{offer.stage}'s in its TOML (rank 0 at {stage.address}, then "
                       f"{list(agents)})", False)
    return None


def _judge_rank(offer: Offer, me: PeerFacts, cfg: ClusterConfig,
                bound_identity: HostPort) -> ClusterConfig | Refusal:
    """A rank past 0 of a mesh's stage: its node, its host, its coordinator."""
    stage = cfg.stages[offer.stage]
    node = cfg.node(offer.node_id)
    if (offer.node_id != f"{stage.id}-tp-{offer.tp_rank}" or node is None
            or not node.is_mesh or node.rank != offer.tp_rank or node.layers != offer.layers):
        return Refusal("node_id", f"the offer names node {offer.node_id!r} for rank "
                       f"{offer.tp_rank} of stage {offer.stage}; expected "
                       f"'{stage.id}-tp-{offer.tp_rank}' with its layers in the TOML too",
                       False)
    if not _is_mine(parse_address(node.address).host, me.agent_host):
        return Refusal("listener", f"the offer places rank {offer.tp_rank} of stage "
                       f"{offer.stage} at {node.address}; this node's agent listens on "
                       f"{me.agent_host}", False)
    return _from_coordinator(offer, cfg, bound_identity) or cfg


def offered_node(stage: int, toml: str, me: str) -> str:
    """This peer's node of stage ``stage`` in a plan's TOML (judged): ``stage-K``, or in a
    2D mesh the rank past 0 of it whose agent address is ``me`` (``stage-K-tp-R``)."""
    node = f"stage-{stage}"
    try:
        cfg = parse_cluster_text(toml, Path("offer.toml"))
        mine = canonical_address(me)
        if cfg.mesh:
            return next((n.id for n in cfg.stage_ranks(cfg.stages[stage].id)[1:]
                         if canonical_address(n.address) == mine), node)
    except (ConfigError, ValueError, IndexError):
        pass  # judged before: a TOML that reads so places the stage as it always has
    return node


def _same_host(a: str, b: str) -> bool:
    try:
        return parse_address(a).host == parse_address(b).host
    except ValueError:
        return False


def _is_mine(stage_host: str, agent_host: str) -> bool:
    """Whether a stage on ``stage_host`` is on this node (the module docstring, 8)."""
    agent = ip_or_none(agent_host)
    try:
        stage = resolve_blocking(stage_host)
        if agent is not None and agent.is_unspecified:
            return any(not ip.is_unspecified and is_local_ip(ip) for ip in stage)
        return bool(stage & resolve_blocking(agent_host))
    except ResolveError:
        return False
