"""Which workers a daemon should run: a pure function of its config and its state.

``draw_roster`` reads nothing but its ``Situation`` (no database, no keyring, no
clock) and returns the ``WorkerSpec`` of every worker that should run; the
daemon hands that to the supervisor's ``reconcile`` whenever one of its inputs
changes (start, SIGHUP, `mlxctl serve|unserve`, a plan pushed, a stage
prepared or activated, a deactivation). The rules, in order:

- every ``[workers.NAME]`` of the config runs, with its options and policy;
- a stage node of a placement (a cluster TOML, or a pushed plan) runs the
  ``stage`` worker, in standby while its assignment is only prepared, with the
  cluster secret (and ``[serve] stage_silence_s`` for its links' heartbeat); with
  ``[serve] tp_size`` N > 1 the stage is a tensor-parallel group on this host: the
  ``stage`` worker is rank 0 of group ``stage-tp``, with N-1 ``stage_tp`` workers
  ``stage-tp-1`` ... (ranks 1..N-1: the stage's model and layers, no secret), meeting
  in a ring at ``Situation.tp_hosts``, restarted together as a router's group; with
  ``tp_peers`` too (or a 2D mesh's placement with its ``tp_peers``: ``stage_group``) the
  group spans hosts: no ``stage-tp`` worker here, and the ``stage`` worker only once its
  ring is formed (``daemon/stage_peers.py``);
- a prefill or decode node (``--node-role prefill|decode``) runs the ``router``
  with ``handoff`` options (no OpenAI port: its engine on the serving listener
  only) with the cluster secret, once its agent listener is bound, when there is
  a model to serve;
- a router in front of a pipeline (``--node-role router`` with ``[serve]
  pipeline_coordinator``, ``config/front.py``) runs the ``router`` over the stages it last
  learnt from that coordinator (``followed``, ``daemon/following.py``), with the cluster
  secret, when there is a model to serve (its tokenizer), and none before it learnt any;
- a router node (``--node-role router``) runs the ``router`` over its
  ``replicas`` (and its prefill and decode pools) with the cluster secret,
  once its agent listener is bound (its address is the identity the router
  dials with), when there is a model to serve (its tokenizer; the replicas
  hold the weights);
- else the ``router`` runs when there is a model to serve and the daemon is no
  ``--pp-peer``: over the pipeline with the cluster secret when the placement
  makes it the coordinator, else on the model alone unless the router is held
  back (``pp_auto`` waiting for its plan, a plan to resume at start, or after
  `mlxctl cluster deactivate`, until `mlxctl serve`). Whenever the daemon holds the
  cluster secret the router gets it too, with ``serving`` (``ServingOptions``): it
  serves its engine to the cluster's routers on the agent listener's host and
  ``[serve] serving_port`` (``replicas/service.py``). With ``[serve] tp_size`` N > 1
  (tensor parallelism, on the model alone: no placement) it is rank 0 of a group
  ``tp`` with N-1 ``tp`` workers ``tp-1`` ... ``tp-{N-1}`` (ranks 1..N-1: the model's
  policy, no secret, no API key), meeting in a ring at ``Situation.tp_hosts``; the
  supervisor restarts the group together (``supervisor/groups.py``).

Beside those, ``Roster.retiring``: a stage host's stage that the next plan replaces runs
on, renamed ``stage-retiring``, until that plan serves (``cluster/assignment/
stagehost.py``: make before break).

``Roster`` holds those inputs as they change (the config at a reload, what the router
serves, the placement and its standby, the ring's ports, ...) and is the one place that
draws the roster and hands it to the supervisor (``reconcile``): whoever changes an input
calls it.

It lives in the daemon room, beside ``root.py``, not in ``supervisor/``: the supervisor
runs any spec it is given and knows no roles, while this is the daemon's policy over
roles, placements and ``[serve]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from mlxceld.cluster.clusterfile.placement import (
    STAGE_TP_GROUP,
    STAGE_WORKER,
    Placement,
    pipeline_options,
    replica_pipelines,
    stage_options,
)
from mlxceld.config.daemon import Config
from mlxceld.config.front import FOLLOW_S
from mlxceld.config.serve import ROUTER, ServeConfig, router_options
from mlxceld.discovery.inventory import ring_ports
from mlxceld.logformat import LogFormat
from mlxceld.pipeline.replay import hold_for
from mlxceld.roles.options import (
    HandoffOptions,
    PipelineOptions,
    ReplicasOptions,
    RouterOptions,
    ServingOptions,
    StageOptions,
    StageTensorOptions,
    TensorOptions,
)
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.supervisor.states import RestartPolicy
from mlxceld.types import HANDOFF_SIDES, ROUTER_ROLE, TENSOR_RANK_ROLE
from mlxceld.wire.address import format_address, parse_address
from mlxceld.wire.secret import Keyring

# A model takes a while to load; stopping waits for open streams (router.GRACEFUL_S: 10 s)
# and a stage's sequences (pipeline.stage.DRAIN_S: 15 s).
MODEL_START_TIMEOUT_S: Final = 600.0  # after its load last advanced (supervisor/states.py)
MODEL_STOP_TIMEOUT_S: Final = 20.0
TP_GROUP: Final = "tp"  # the router and its tensor-parallel ranks' WorkerSpec.group
# A router in front of a pipeline: its next ask of the plan (FOLLOW_S), and 1 s of slack.
FRONT_ASK_S: Final = FOLLOW_S + 1.0
TP_RING_HOST: Final = "127.0.0.1"  # a tensor-parallel group is on one host: its ring on loopback


@dataclass(frozen=True)
class Situation:
    """Everything the roster depends on."""

    config: Config
    serve: ServeConfig  # what to serve: flags and file, else what `mlxctl serve` chose
    placement: Placement | None = None  # this daemon's node of a cluster, if any
    standby: bool = False  # the stage's assignment is prepared, not yet active
    hold_router: bool = False  # no single-host router for now (see the module docstring)
    secret: bytes | None = field(default=None, repr=False)  # the cluster's primary secret
    accepted: tuple[bytes, ...] = field(default=(), repr=False)  # its other installed keys
    api_key: str | None = field(default=None, repr=False)  # the router's, from its file
    node_id: str | None = None  # this daemon's node id (its serving listener names it)
    agent_address: str | None = None  # the agent listener's, once bound
    # The tensor-parallel ring, host:port per rank (rank 0, the router, first), when
    # serve.tp_size > 1: ports the daemon picked on 127.0.0.1 (``Roster.tp_ring``), kept
    # while tp_size stays the same so a restarted group meets at the same ports.
    tp_hosts: tuple[str, ...] = ()
    # A rank host (node_role tensor_parallel_rank): the rank rank 0's daemon asked it to
    # run (cluster/tensor_rank.py), None until asked.
    tensor_rank: TensorOptions | StageTensorOptions | None = None
    # A router in front of a pipeline ([serve] pipeline_coordinator): the stages it drives,
    # as last learnt from the coordinator (daemon/following.py); None: none learnt yet.
    followed: PipelineOptions | None = None


def draw_roster(s: Situation) -> list[WorkerSpec]:
    """The workers that should run in ``s``, in a stable order."""
    c, p = s.config, s.placement
    specs = [WorkerSpec(w.name, c.state_dir, w.options, w.policy, log_format=c.log_format)
             for w in c.workers]
    policy = model_policy(c.policy)
    if p is not None and not p.is_coordinator:
        stage = stage_options(p, standby=s.standby, silence_s=s.serve.stage_silence_s)
        size, peers = stage_group(p, s.serve)
        tensor = size > 1
        here = tensor and not peers  # its ranks on this host, not the peers'
        if tensor:
            stage = replace(stage, tp_size=size, tp_hosts=s.tp_hosts)
        if here or s.tp_hosts or not tensor:  # a group across hosts: once formed
            specs.append(WorkerSpec(STAGE_WORKER, c.state_dir, stage, policy,
                                    secret=s.secret, accepted=s.accepted,
                                    log_format=c.log_format,
                                    group=STAGE_TP_GROUP if here else None))
        if here:
            specs += stage_ranks(stage, c.state_dir, policy, c.log_format)
    elif s.serve.node_role in HANDOFF_SIDES:
        serving = serving_options(s)
        if s.serve.model is not None and s.agent_address is not None and serving is not None:
            handoff = HandoffOptions(s.serve.node_role, s.agent_address,
                                     s.serve.prefill_peers)
            specs.append(WorkerSpec(ROUTER, c.state_dir,
                                    router_options(s.serve, serving=serving, handoff=handoff),
                                    policy, secret=s.secret, accepted=s.accepted,
                                    log_format=c.log_format))
    elif s.serve.node_role == TENSOR_RANK_ROLE or (c.pp_peer and s.tensor_rank is not None):
        # a rank host's, or a stage host's offered a 2D mesh's rank past 0 (stagehost.py)
        if s.tensor_rank is not None:  # no router: rank 0's host serves
            name = (f"{STAGE_TP_GROUP}-{s.tensor_rank.rank}"
                    if isinstance(s.tensor_rank, StageTensorOptions)
                    else f"{TP_GROUP}-{s.tensor_rank.rank}")
            specs.append(WorkerSpec(name, c.state_dir, s.tensor_rank, policy,
                                    log_format=c.log_format))
    elif s.serve.node_role == ROUTER_ROLE and s.serve.pipeline_coordinator is not None:
        # A standby that took over drives the plans it pushed since (daemon/standby.py).
        followed = pipeline_options(p) if p is not None and p.is_coordinator else s.followed
        if s.serve.model is not None and followed is not None:
            # Its coordinator heals the plan; this router moves to the healed one at its
            # next ask (``FOLLOW_S``, 1 s): a sequence that lost a stage is held
            # for the heal's bound and that ask, then replayed (``pipeline/replay.py``).
            hold = hold_for(c.liveness.dead_after_s, c.heal_after_s) + FRONT_ASK_S
            specs.append(WorkerSpec(ROUTER, c.state_dir,
                                    replace(router_options(s.serve, followed),
                                            replay_hold_s=hold),
                                    policy, api_key=s.api_key, secret=s.secret,
                                    accepted=s.accepted, log_format=c.log_format))
    elif s.serve.node_role == ROUTER_ROLE:
        if s.serve.model is not None and s.agent_address is not None:
            replicas = ReplicasOptions(agents=s.serve.replicas, origin=s.agent_address,
                                       cluster=c.cluster_name,
                                       prefill_agents=s.serve.prefill_peers,
                                       decode_agents=s.serve.decode_peers,
                                       kv_compression=s.serve.kv_compression,
                                       discover=not s.serve.replicas
                                       and not s.serve.prefill_peers)
            specs.append(WorkerSpec(ROUTER, c.state_dir, router_options(s.serve,
                                                                        replicas=replicas),
                                    policy, api_key=s.api_key, secret=s.secret,
                                    accepted=s.accepted, log_format=c.log_format))
    elif (s.serve.model is not None and not c.pp_peer and (p is not None or not s.hold_router)
          and not (s.serve.tp_peers and not s.tp_hosts)):  # a group across hosts: formed
        options = router_options(s.serve, pipeline_options(p) if p is not None else None,
                                 serving_options(s))
        if p is not None and p.cluster.replicas > 1:  # the groups past the first
            options = replace(options, replica_pipelines=replica_pipelines(p))
        elif p is not None and c.distributed_config is None:  # a plan its coordinator heals
            options = replace(options, replay_hold_s=hold_for(c.liveness.dead_after_s,
                                                              c.heal_after_s))
        keyed = p is not None or options.serving is not None
        tensor = p is None and s.serve.tp_size > 1
        here = tensor and not s.serve.tp_peers  # its ranks on this host, not the peers'
        if tensor:
            options = replace(options, tp_size=s.serve.tp_size, tp_hosts=s.tp_hosts,
                              share_port=bool(s.serve.tp_peers))
        specs.append(WorkerSpec(ROUTER, c.state_dir, options, policy, api_key=s.api_key,
                                secret=s.secret if keyed else None,
                                accepted=s.accepted if keyed else (),
                                log_format=c.log_format, group=TP_GROUP if here else None))
        if here:
            specs += tensor_ranks(options, c.state_dir, policy, c.log_format)
    return specs


def stage_group(p: Placement | None, serve: ServeConfig) -> tuple[int, tuple[str, ...]]:
    """A stage's tensor-parallel group: its size and the agents of its ranks on other
    hosts (() when its ranks are on this host). A 2D mesh's placement says it
    (``Placement.tp_peers``), else ``[serve]`` (``--tp-size``, ``--tp-peers``)."""
    if p is not None and p.tp_peers:
        return len(p.tp_peers) + 1, p.tp_peers
    return serve.tp_size, serve.tp_peers


def tensor_ranks(router: RouterOptions, state_dir: Path, policy: RestartPolicy,
                 log_format: LogFormat) -> list[WorkerSpec]:
    """The ``tp`` workers of ``router``'s tensor-parallel group: ranks 1..tp_size-1, each
    ``tp-<rank>``, with the router's model and batch size (the ring's ranks must agree),
    and no secret or API key: they serve nothing but the ring. None while the ring has no
    port per rank (the daemon could bind none: the router refuses that, naming it)."""
    if len(router.tp_hosts) != router.tp_size:
        return []
    return [WorkerSpec(f"{TP_GROUP}-{rank}", state_dir,
                       TensorOptions(model=router.model, model_name=router.model_name,
                                     rank=rank, tp_hosts=router.tp_hosts,
                                     max_batch=router.max_batch),
                       policy, log_format=log_format, group=TP_GROUP)
            for rank in range(1, router.tp_size)]


def stage_ranks(stage: StageOptions, state_dir: Path, policy: RestartPolicy,
                log_format: LogFormat) -> list[WorkerSpec]:
    """The ``stage_tp`` workers of a tensor-parallel stage: ranks 1..tp_size-1, each
    ``stage-tp-<rank>``, with the stage's model and layers, and no secret: they serve
    nothing but the ring. None with tp_size 1, or while the ring has no port per rank (the
    stage refuses that, naming it)."""
    if stage.tp_size == 1 or len(stage.tp_hosts) != stage.tp_size:
        return []
    return [WorkerSpec(f"{STAGE_TP_GROUP}-{rank}", state_dir,
                       StageTensorOptions(model=stage.model, layers=stage.layers,
                                          node_id=stage.node_id, rank=rank,
                                          tp_hosts=stage.tp_hosts),
                       policy, log_format=log_format, group=STAGE_TP_GROUP)
            for rank in range(1, stage.tp_size)]


def serving_options(s: Situation) -> ServingOptions | None:
    """The router's serving listener: with the cluster secret and a node id, on the agent
    listener's host and ``[serve] serving_port``; else None."""
    if s.secret is None or s.node_id is None:
        return None
    host = parse_address(s.config.agent_addr, port_zero=True).host  # 0: an ephemeral agent port
    cluster = s.placement.cluster.name if s.placement is not None else s.config.cluster_name
    return ServingOptions(format_address(host, s.serve.serving_port), s.node_id, cluster)


def model_policy(base: RestartPolicy) -> RestartPolicy:
    """``base`` with room for a worker that loads a model (router, stage)."""
    return replace(base, start_timeout_s=max(base.start_timeout_s, MODEL_START_TIMEOUT_S),
                   stop_timeout_s=max(base.stop_timeout_s, MODEL_STOP_TIMEOUT_S))


def router_needs(specs: list[WorkerSpec], own: set[str]) -> frozenset[str] | None:
    """The nodes the router's requests need: ``own`` (this node's ids), and a pipeline's
    stages; None where the roster runs no router. Over replica groups no stage is needed
    by every request: a drained stage refuses new sequences and its group's are sent to
    the other groups (``replicas/groups.py``)."""
    spec = next((s for s in specs if s.name == ROUTER), None)
    if spec is None:
        return None
    if (isinstance(spec.options, RouterOptions) and spec.options.pipeline is not None
            and not spec.options.replica_pipelines):
        own = own | {s.node_id for s in spec.options.pipeline.stages}
    return frozenset(own)


class Roster:
    """The roster's inputs now, and the one reconcile: ``draw_roster`` of them handed to
    the supervisor. ``serve`` and ``hold_router`` are the serving window's to set,
    ``placement`` and ``standby`` the cluster member's (its stage host's ``set_stage``),
    ``config`` and ``api_key`` the reload's."""

    def __init__(self, config: Config, supervisor: Supervisor, keyring: Keyring, *,
                 placement: Placement | None, node_id: str, api_key: str | None,
                 agent_address: Callable[[], str | None]) -> None:
        self.config = config
        self.serve = config.serve  # what the router serves: the serving window's
        self.hold_router = False  # no single-host router while a pipeline is to come
        self.placement = placement
        self.standby = False  # the stage worker starts in standby (a prepared assignment)
        self.retiring: WorkerSpec | None = None  # a replaced stage kept serving (stagehost)
        self._supervisor = supervisor
        self._keyring = keyring
        self._node_id = node_id
        self.api_key = api_key  # the router's, from its file: the reload's to replace
        self._agent_address = agent_address  # the agent listener's, once bound
        self._tp_hosts: tuple[str, ...] = ()  # the tensor-parallel ring (tp_ring)
        # Across hosts: the ring rank 0's daemon formed (daemon/tensor_peers.py), None while
        # it is not formed (no router); on a rank host, the rank it was asked to run.
        self.tensor_ring: tuple[str, ...] | None = None
        self.tensor_rank: TensorOptions | StageTensorOptions | None = None
        self.followed: PipelineOptions | None = None  # a front's plan (daemon/following.py)

    def specs(self) -> list[WorkerSpec]:
        """The workers to run now: ``draw_roster`` of the inputs."""
        ring = self._keyring
        secret = ring.primary if len(ring) else None
        specs = draw_roster(Situation(
            self.config, self.serve, self.placement, standby=self.standby,
            hold_router=self.hold_router, secret=secret,
            accepted=tuple(ring.others()), api_key=self.api_key, node_id=self._node_id,
            agent_address=self._agent_address(), tp_hosts=self.tp_ring(),
            tensor_rank=self.tensor_rank, followed=self.followed))
        if self.retiring is not None:  # with the keyring of now, as every worker's
            specs.append(replace(self.retiring, secret=secret, accepted=tuple(ring.others())))
        return specs

    async def reconcile(self) -> list[WorkerSpec]:
        """Make the running workers match ``specs()``; the specs it drew."""
        specs = self.specs()
        await self._supervisor.reconcile(specs)
        return specs

    def set_stage(self, placement: Placement | None, *, standby: bool) -> None:
        """Run ``placement``'s stage (in standby: loaded, not serving), or none (the
        cluster member's stage host: ``cluster/assignment/stagehost.py``'s ``StageSlot``);
        the next ``reconcile`` makes it so."""
        self.placement, self.standby = placement, standby

    def grouped(self) -> bool:
        """Whether this host's stage is a tensor-parallel group (``[serve] tp_size``, or a
        2D mesh's placement)."""
        return stage_group(self.placement, self.serve)[0] > 1

    def stage_across(self) -> bool:
        """Whether this host's stage is a group across hosts: a ``--pp-peer`` stage host
        with ``--tp-peers``, or a 2D mesh's stage (``Placement.tp_peers``)."""
        p = self.placement
        return bool(p is not None and p.tp_peers) or (self.config.pp_peer
                                                      and bool(self.serve.tp_peers))

    def keep_retiring(self, spec: WorkerSpec | None) -> None:
        """Run ``spec`` (a stage the next plan replaces, renamed) beside the placement's
        workers until it is None again (``stagehost.StageSlot``)."""
        self.retiring = spec

    def spec(self, name: str) -> WorkerSpec | None:
        """The worker ``name`` as the roster draws it now; None where it runs no such one."""
        return next((s for s in self.specs() if s.name == name), None)

    def served_pipeline(self) -> PipelineOptions | None:
        """The pipeline this coordinator's router drives (the ``plan`` answer,
        ``cluster/front.py``); None on any other daemon, and over replica groups."""
        p = self.placement
        spec = self.spec(ROUTER) if p is not None and p.is_coordinator else None
        if spec is None or not isinstance(spec.options, RouterOptions):
            return None
        return None if spec.options.replica_pipelines else spec.options.pipeline

    def stage_wanted(self) -> bool:
        """Whether the active plan (not in standby) wants this host's stage worker."""
        return (self.placement is not None and not self.standby
                and self.spec(STAGE_WORKER) is not None)

    def router_held(self) -> bool:
        """Whether the router waits for a pipeline (pp_auto, a plan to resume)."""
        return self.hold_router and self.placement is None

    def tp_ring(self) -> tuple[str, ...]:
        """The tensor-parallel group's ring, ``host:port`` per rank: ``tp_size`` ports free on
        127.0.0.1, picked when a tp size first needs them and kept while it stays the same
        (a restarted group meets at the same ports: the ring's ranks bind them again at
        once); () with tp_size 1, or when none could be bound (the router refuses that,
        naming it). Across hosts (``tp_peers``), the ring the group formed with, if it has.
        """
        tp_size = self.serve.tp_size
        if self.serve.tp_peers or self.stage_across():  # the ring formed across hosts
            return self.tensor_ring or ()
        if tp_size <= 1:
            self._tp_hosts = ()
        elif len(self._tp_hosts) != tp_size:
            self._tp_hosts = tuple(f"{TP_RING_HOST}:{port}"
                                   for port in ring_ports(TP_RING_HOST, tp_size))
        return self._tp_hosts
