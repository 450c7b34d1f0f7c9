"""This daemon as a member of the cluster: with a cluster secret, the agent listener
(``net/agent.py``) and what runs with it (inventory and plan queries, discovery, the failure
detector's heartbeats, the ``Assignee`` over a ``LocalStageHost``, the ``Coordinator``), and the
control API's cluster commands (`mlxctl cluster nodes|plan|activate|deactivate`, ``--dry-run``),
and `mlxctl secret rotate`: the key ops every member answers and this daemon's ``Rotator``
(``cluster/rotation.py``), which resumes an unfinished rotation once the agent listener is up.

The heartbeats watch every candidate peer and, on a coordinator, every peer of its
active plan (``discovery/heartbeat.py``): a suspect or dead one is a status problem.

The daemon hands the member ``MemberParts``, a record of what it uses, never the daemon:
its configuration (replaced on a reload), whether it stops, the model it serves, and the
parts the coordinator, the stage host and the key ops work on (the serving window's
``serve_pipeline``, the roster's ``set_stage`` and ``reconcile``, the key window).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from mlxceld.cluster import adoption, healing
from mlxceld.cluster.assignment.peer import Assignee
from mlxceld.cluster.assignment.query import serve_queries
from mlxceld.cluster.assignment.stagehost import LocalStageHost, StageSlot
from mlxceld.cluster.bringup import resumed_model
from mlxceld.cluster.clusterfile.placement import Placement, place
from mlxceld.cluster.coordinator import Coordinator, CoordinatorSlot
from mlxceld.cluster.fencing import Fence, serve_assignment
from mlxceld.cluster.front import Fronts, plan_of, serve_plan
from mlxceld.cluster.healer import TICK_S, Healer
from mlxceld.cluster.lease import Lease, StillHeard, still_heard
from mlxceld.cluster.plan.candidates import Proposal
from mlxceld.cluster.rotation import KeyOps, Rotator, serve_key_ops
from mlxceld.config.daemon import Config
from mlxceld.control.answers import ClusterNodes, Detector
from mlxceld.discovery.candidates import CandidateTable
from mlxceld.discovery.heartbeat import Heartbeats
from mlxceld.discovery.inventory import model_entry, serve_inventory
from mlxceld.discovery.service import DiscoveryService
from mlxceld.discovery.serving import port_of, serve_serving
from mlxceld.errors import ConfigError, DaemonError, MlxceldError
from mlxceld.net.agent import AgentService
from mlxceld.net.link import serve_link
from mlxceld.net.route import interfaces, link_to
from mlxceld.roles import ROUTER
from mlxceld.roles.options import PipelineOptions
from mlxceld.state import EventLog, LivenessTable, RotationRow, RotationsTable, Settings
from mlxceld.state.plans import Assignments, Plans
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import DEFAULT_MESH, JSON, MeshMode
from mlxceld.wire.address import parse_address
from mlxceld.wire.agent_messages import Plan, Serving
from mlxceld.wire.secret import Keyring

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemberParts:
    """What the member uses of its daemon (``daemon/root.py`` makes it)."""

    config: Callable[[], Config]  # now: a reload replaces it
    stopping: Callable[[], bool]
    served_model: Callable[[], str | None]  # what the router serves or would (inventory)
    router_held: Callable[[], bool]  # the router waits for a pipeline (pp_auto, a resume)
    drained_nodes: Callable[[], frozenset[str]]  # `mlxctl drain`'s: left out of plans
    pipeline: CoordinatorSlot  # the router over a pushed plan (the serving window)
    stage: StageSlot  # the placement and standby, and the reconcile (the roster)
    keys: KeyOps  # the keyring's changes, each pushed to the workers (the key window)
    # The pipeline our router drives now (the ``plan`` answer, cluster/front.py)
    served_pipeline: Callable[[], PipelineOptions | None] = lambda: None
    fronts: Fronts | None = None  # who asked for it (the serving window waits for them)
    units: Callable[[], float | None] = lambda: None  # compute units (discovery/speed.py)
    more: Callable[[AgentService], None] = lambda agent: None  # the daemon's other answers


class ClusterMember:
    def __init__(self, parts: MemberParts, supervisor: Supervisor, events: EventLog,
                 keyring: Keyring, *, node_id: str, candidates: CandidateTable, plans: Plans,
                 assignments: Assignments, liveness: LivenessTable,
                 rotations: RotationsTable, settings: Settings) -> None:
        self._parts = parts
        self._supervisor = supervisor
        self._events = events
        self._keyring = keyring
        self._node_id = node_id
        self._candidates = candidates
        self._plans = plans
        self._assignments = assignments
        self._liveness = liveness
        self._rotations = rotations
        self._settings = settings  # a stage host's lease is kept there (cluster/lease.py)
        self._rotator: Rotator | None = None
        self._heartbeats: Heartbeats | None = None
        agent = parse_address(parts.config().agent_addr, port_zero=True)  # the config checked it
        self._agent_addr = (agent.host, agent.port)
        self.agent: AgentService | None = None
        self._agent_bound = False
        self._agent_error: str | None = None
        self._discovery: DiscoveryService | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._assignee: Assignee | None = None
        self._coordinator: Coordinator | None = None
        self._healer: Healer | None = None
        self._fence = Fence(plans, events)  # a coordinator a standby superseded stands down

    # -- what `mlxctl status` and `mlxctl cluster nodes` show -------------------------------

    def describe(self) -> JSON:
        """The ``assignment``, ``bringup`` and ``agent`` parts of the daemon's status."""
        return {
            "assignment": self._assignee.describe() if self._assignee else None,
            "bringup": self._coordinator.state if self._coordinator else None,
            "healing": self._healer.state if self._healer else None,
            "stood_down": self._fence.describe(),  # cluster/fencing.py
            # the address only once bound: before, its port may still be the 0 asked for
            "agent": {"address": self.agent.address if self.agent and self._agent_bound
                      else None,
                      "error": self._agent_error if not self.agent else None,
                      "keys": len(self._keyring)},
        }

    def agent_address(self) -> str | None:
        """The agent listener's address once bound (its port resolved), else None."""
        return self.agent.address if self.agent is not None and self._agent_bound else None

    def nodes(self) -> ClusterNodes:
        c = self._parts.config()
        discovery = (self._discovery.describe() if self._discovery else
                     {"mode": c.cluster_discovery, "running": False, "address": None,
                      "advertised": None, "error": None if len(self._keyring) else
                      "no cluster secret: discovery runs with the agent listener"})
        rows = self._liveness_rows()
        ours = self._keyring.primary_id.hex() if self._keyring.primary_id else None
        # key_stale: the peer's primary (its inventory's, or its mDNS record's key id) is not
        # ours: it missed a rotation, and its traffic fails once the old key is removed.
        table = interfaces()
        nodes = [{**n, "liveness": rows.get(n["address"]),
                  "key_stale": bool(ours and n.get("key_id") and n["key_id"] != ours),
                  "link": link.to_json() if (link := link_to(
                      parse_address(n["address"]).host, table)) else None}
                 for n in self._candidates.snapshot()]
        detector = Detector(self._heartbeats is not None, c.liveness.ping_interval_s,
                            c.liveness.suspect_after_s, c.liveness.dead_after_s)
        return ClusterNodes(c.cluster_name, self._node_id, ours, discovery, nodes, detector,
                            [rows[a] for a in sorted(rows)])

    def drain_started(self, node: str, force: bool) -> None:
        """`mlxctl drain NODE` was recorded: on a coordinator, re-plan around it if it
        holds a stage of the plan served (``Healer.drain_started``)."""
        if self._healer is not None:
            self._healer.drain_started(node, force)

    def drain_held(self) -> frozenset[str]:
        """The drained nodes whose drain waits for a re-plan before the router hears it."""
        return self._healer.holding() if self._healer is not None else frozenset()

    def plan_node_ids(self) -> frozenset[str]:
        """The node ids of the hosts of the plan this daemon coordinates (as `mlxctl
        cluster nodes` names them): what its router's requests need."""
        return frozenset(r.node_id for a in self._plan_peers()
                         if (r := self._candidates.get(a)) is not None and r.node_id)

    def _drained_addresses(self) -> dict[str, str]:
        """Agent address -> node id of the candidates that are drained."""
        drained = self._parts.drained_nodes()
        return {r["address"]: r["node_id"] for r in self._candidates.snapshot()
                if r.get("node_id") in drained} if drained else {}

    def keyring_changed(self) -> None:
        """Our keyring changed: poll every peer now, so that ``nodes`` shows which of them
        dial with another primary (``key_stale``) without waiting for the next poll."""
        if self._discovery is not None:
            self._discovery.repoll()

    def problems(self) -> list[JSON]:
        """On a coordinator, each peer of its active plan that the failure detector holds
        suspect or dead: what, since when, why, and what to do."""
        rows = self._liveness_rows()
        out: list[JSON] = self._healer.problems() if self._healer else []
        for address in self._plan_peers():
            row = rows.get(address)
            if row is None or row["state"] not in ("suspect", "dead"):
                continue
            name = f"node {row['node_id']} ({address})" if row["node_id"] else f"peer {address}"
            last = (f"; its last answer was at {_clock(row['last_answer'])}"
                    if row["last_answer"] else "")
            out.append({"subject": row["node_id"] or address, "since": row["since"],
                        "message": f"{name} of the active plan is {row['state']} since "
                        f"{_clock(row['since'])}: {row['reason']}{last}",
                        "next": f"check the host of {address}: awake, on the network, "
                        "mlxceld running (mlxctl status there); it is marked alive again as "
                        "soon as it answers: mlxctl cluster nodes"})
        return out

    def _liveness_rows(self) -> dict[str, JSON]:
        """The failure detector's rows by address (the table's while it does not run)."""
        if self._heartbeats is not None:
            return {r["address"]: r for r in self._heartbeats.snapshot()}
        return {r.address: r.to_json() for r in self._liveness.all()}

    def _plan_peers(self) -> tuple[str, ...]:
        """The peers of the plan this daemon coordinates and keeps up, if any."""
        if not self.may_coordinate():
            return ()
        served = self._coordinator.serving if self._coordinator else None
        if served is not None:  # a heal that did not end active leaves it the newest
            return served.peers
        last = self._plans.resumable()
        return last.peers if last is not None else ()

    def _watched(self) -> list[str]:
        """Whom the heartbeats watch: the candidates and the active plan's peers."""
        return sorted({*self._candidates.addresses(), *self._plan_peers()})

    # -- mlxctl cluster plan|activate|deactivate, --dry-run ---------------------------------

    async def plan(self, model: str, stages: int, replicas: int = 1,
                   mesh: MeshMode = DEFAULT_MESH) -> Proposal:
        """`mlxctl cluster plan` (``Coordinator.propose``). Assigns nothing."""
        return await self._coordinating().propose(model, stages, replicas=replicas, mesh=mesh)

    async def activate(self, model: str, stages: int, replicas: int = 1,
                       mesh: MeshMode = DEFAULT_MESH) -> JSON:
        """`mlxctl cluster activate` (``Coordinator.activate``): plans now, pushes and
        serves in our task group; the answer carries the plan's epoch."""
        coordinator = self._pushing_plans("activate")
        if self._parts.stopping() or self._tg is None:
            raise DaemonError("the daemon is shutting down and starts no bring-up",
                              hint="start it again, then activate")
        return await coordinator.activate(model, stages, replicas, mesh)

    async def deactivate(self) -> JSON:
        """`mlxctl cluster deactivate` (``Coordinator.deactivate``): end the plan on every
        peer and stop our router; the daemon stays up."""
        state = await self._pushing_plans("deactivate").deactivate()
        pp_auto = self._parts.config().pp_auto
        if pp_auto is not None:
            state = {**state, "note": f"pp_auto {pp_auto} is set: the next start "
                     "of this daemon plans and pushes a new plan; remove pp_auto (--pp-auto, "
                     "[daemon] pp_auto) to keep the cluster down"}
        return state

    def _pushing_plans(self, command: str) -> Coordinator:
        """The coordinator, for `mlxctl cluster activate|deactivate`: refused on a daemon
        that takes stages (--pp-peer) or runs a written cluster (--distributed-config)."""
        coordinator = self._coordinating()
        config = self._parts.config()
        if config.pp_peer:
            raise ConfigError("this daemon runs with --pp-peer: it takes stages, it does not "
                              "push plans",
                              hint=f"run mlxctl cluster {command} on the coordinator, a "
                              "daemon without --pp-peer")
        if config.distributed_config is not None:
            raise ConfigError(f"this daemon runs the cluster config "
                              f"{config.distributed_config} (--distributed-config), "
                              "which no plan of its own placed",
                              hint=f"start it without --distributed-config to {command} a "
                              "plan; a written cluster stops with its daemons")
        if config.serve.tp_size > 1:
            raise ConfigError(f"this daemon runs with tp_size {config.serve.tp_size} "
                              "(--tp-size, [serve] tp_size): a pipeline's coordinator holds "
                              "no layers to split (its router drives the stages)",
                              hint=f"run mlxctl cluster {command} on a daemon without "
                              "--tp-size, or drop it here and reload (SIGHUP); give the "
                              "stage hosts --tp-size (beside --pp-peer) instead")
        return coordinator

    def _coordinating(self) -> Coordinator:
        if self._coordinator is None:
            raise ConfigError("planning needs discovery, which runs with the agent listener "
                              "once the daemon has a cluster secret",
                              hint="install one: mlxctl secret install FILE --primary")
        return self._coordinator

    async def dry_run(self) -> str:
        """``--pp-auto N --dry-run``: the plan's report for the terminal; ``ConfigError``
        without a cluster secret or a model, or what ``Coordinator.dry_run`` raises."""
        model, config = self._parts.served_model(), self._parts.config()
        if self._coordinator is None or model is None:
            raise ConfigError("--pp-auto needs a cluster secret and --model DIR",
                              hint="give the cluster secret (--cluster-secret-file) and "
                              "the model to plan")
        return await self._coordinator.dry_run(config.pp_auto or 0, model, config.mesh)

    # -- mlxctl secret rotate -----------------------------------------------------------------

    async def rotate(self, secret: bytes | None) -> RotationRow:
        """`mlxctl secret rotate` (``cluster/rotation.py``) over this daemon and its
        candidates; refused without the agent listener (it carries the new secret)."""
        if self._rotator is None:
            raise ConfigError("a secret rotation needs the agent listener, which runs once "
                              "the daemon has a cluster secret",
                              hint="install one: mlxctl secret install FILE --primary")
        return await self._rotator.rotate(secret)

    def rotation(self) -> RotationRow | None:
        """The latest rotation (its step, members, failures), None before the first."""
        return self._rotations.latest()

    # -- plans of our own ---------------------------------------------------------------------

    def may_coordinate(self) -> bool:
        """A peer, a node of a written cluster or a host of a tensor-parallel group
        (``tp_size`` above 1: no pipeline is built over one) never resumes a plan of its
        own."""
        c = self._parts.config()
        return not c.pp_peer and c.distributed_config is None and c.serve.tp_size == 1

    def check_reload(self, new: Config) -> None:
        """A reload to ``tp_size`` above 1 while this daemon coordinates a plan it keeps up:
        refused (``ConfigError``; the running config stays)."""
        if new.serve.tp_size > 1 and self._plan_peers():
            raise ConfigError(f"tp_size {new.serve.tp_size} (--tp-size, [serve] tp_size) "
                              "while this daemon coordinates a pipeline plan: its "
                              "router holds no layers to split",
                              hint="mlxctl cluster deactivate first, then reload; a stage "
                              "host takes --tp-size (beside --pp-peer)")

    def resumes_a_plan(self) -> bool:
        """Whether a plan is to be resumed at start (``Plans.resumable``)."""
        last = self._plans.resumable()
        if last is None:
            return False
        if self.may_coordinate():
            return True
        c = self._parts.config()
        log.warning("plan %d (%s) is not resumed: this daemon now runs with %s", last.epoch,
                    last.decision, "pp_peer" if c.pp_peer else "distributed_config"
                    if c.distributed_config is not None else f"tp_size {c.serve.tp_size}")
        return False

    def resumed_placement(self) -> Placement | None:
        """The placement of an active plan to be resumed at start, on the model it will be
        served on (``bringup.resumed_model``), so that the router still running from before
        a restart is re-adopted rather than started again; None if there is none, or it
        cannot be read (the resume says why)."""
        last = self._plans.resumable()
        if last is None or last.decision != "active" or not self.may_coordinate():
            return None
        c = self._parts.config()
        path = c.state_dir / f"cluster-{last.epoch}.toml"
        try:
            model, _ = resumed_model(last, path, c.serve.model)
            return place(path, "coordinator", model)
        except (MlxceldError, OSError):
            return None

    async def adopt(self, plan: Plan, origin: str) -> StillHeard | str | None:
        """A standby's takeover of ``plan``, followed from ``origin``: None once this daemon
        coordinates it, else why not (``cluster/adoption.py``'s ``take_over``)."""
        if self._coordinator is None or self.agent is None or plan.epoch is None:
            return "no agent listener: nothing to coordinate with"
        alive = [a for a, r in self._liveness_rows().items() if r.get("state") == "alive"]
        me, epoch = self.agent.address, plan.epoch
        return await adoption.take_over(
            plan, origin, self._parts.served_model(), self._coordinator, plans=self._plans,
            candidates=self._candidates.addresses(), alive=alive, still_heard=lambda peers:
            still_heard(peers, epoch, identity=me, keyring=self._keyring))

    def _peer_asked(self, epoch: int, decision: str) -> None:
        if (self._coordinator is not None and self.may_coordinate()
                and self._fence.stood_down is None):
            self._coordinator.peer_asked(epoch, decision)

    # -- lifetime -----------------------------------------------------------------------------

    async def start(self, tg: asyncio.TaskGroup) -> None:
        """The MXCL agent listener, whenever there is a cluster secret, and what runs with
        it in ``tg``; a bind failure is reported (log, event, status) and leaves the daemon
        running single-host."""
        self._tg = tg
        if self.agent is not None or self._parts.stopping():
            return
        parts = self._parts
        # A connected peer silent for the detector's suspect bound is dropped (net/agent.py).
        agent = AgentService(self._agent_addr, self._keyring,
                             silence_s=parts.config().liveness.suspect_after_s)
        serve_inventory(agent, self._node_id, parts.served_model, parts.config().stage_ports,
                        keyring=self._keyring, units=parts.units)
        serve_serving(agent, self._serving)
        serve_plan(agent, lambda: plan_of(parts.served_pipeline(), self._coordinator.serving
                                          if self._coordinator else None), parts.fronts)
        serve_queries(agent, self._plans, asked=self._peer_asked)
        c = parts.config()
        lease = Lease(self._assignments, self._settings, heard=agent.last_heard,
                      length_s=lambda: parts.config().liveness.dead_after_s)
        serve_assignment(agent, self._assignments, lease)
        stages = LocalStageHost(parts.stage, self._supervisor, self._events, cluster=c.cluster_name,
                                state_dir=c.state_dir, model=parts.served_model,
                                agent_host=lambda: agent.host, stage_ports=c.stage_ports)
        assignee = Assignee(self._assignments, stages, self._keyring,
                            identity=lambda: agent.address, state_dir=c.state_dir,
                            enabled=c.pp_peer, events=self._events, leased=lease.refusal)
        assignee.register(agent)
        serve_key_ops(agent, parts.keys, self._keyring)
        serve_link(agent)  # `mlxctl cluster link-test` of another daemon
        parts.more(agent)  # a tensor rank host's (daemon/tensor_rank.py)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                await agent.run(started)
            except OSError as exc:
                self._agent_error = (f"cannot listen on {self._agent_addr[0]}:"
                                     f"{self._agent_addr[1]}: {exc.strerror}")
                if parts.router_held():
                    self._agent_error += ("; no pipeline is brought up or resumed without it "
                                          "(restart the daemon once the address is free)")
                log.error("agent listener: %s", self._agent_error)
                self._events.append("agent.failed", "agent", self._agent_error)
                self.agent, self._agent_bound = None, False
                if not started.done():
                    started.set_result(None)

        self.agent = agent
        tg.create_task(run())
        await started
        if self.agent is not None:
            self._agent_bound = True
            self._agent_error = None
            self._events.append("agent.listening", "agent",
                                f"agent listener on {agent.address}", address=agent.address)
            self._discovery = DiscoveryService(
                self._candidates, self._keyring, node_id=self._node_id,
                cluster=c.cluster_name, peers=c.cluster_peers, mode=c.cluster_discovery,
                agent_address=agent.address, interface=c.cluster_interface)
            tg.create_task(self._discovery.run())
            candidates = self._candidates
            self._heartbeats = Heartbeats(
                c.liveness, self._keyring, agent.address, peers=self._watched,
                store=self._liveness, events=self._events,
                node_of=lambda a: row.node_id if (row := candidates.get(a)) else None)
            tg.create_task(self._heartbeats.run())
            self._coordinator = Coordinator(
                parts.pipeline, tg, cluster=c.cluster_name, state_dir=c.state_dir,
                config_out=c.cluster_config_out, plans=self._plans, keyring=self._keyring,
                discovery=self._discovery, identity=agent.address, events=self._events,
                drained=parts.drained_nodes, kv_quant=lambda: parts.config().serve.kv_quant,
                draft=lambda: (parts.config().serve.draft_model,
                               parts.config().serve.num_draft_tokens))
            self._assignee = assignee
            tg.create_task(assignee.run())
            self._rotator = Rotator(self._rotations, self._keyring, parts.keys, self._events,
                                    identity=agent.address, peers=candidates.addresses, tg=tg)
            self._rotator.resume()
            if self.may_coordinate():
                heartbeats = self._heartbeats
                self._healer = Healer(
                    healing.resumed(self._plans, c.heal_after_s), self._coordinator,
                    self._discovery,
                    liveness=lambda: {r["address"]: (r["state"], r["since"])
                                      for r in heartbeats.snapshot()},
                    candidates=candidates.addresses, events=self._events,
                    keyring=self._keyring, identity=agent.address, cluster=c.cluster_name,
                    tick_s=min(TICK_S, c.liveness.ping_interval_s),
                    drained=self._drained_addresses)
                tg.create_task(self._healer.run())
            if not c.dry_run and self.may_coordinate():
                coordinator, model = self._coordinator, parts.served_model()
                tg.create_task(self._fence.start(
                    lambda: coordinator.start(c.pp_auto, model, c.serve.model, c.mesh),
                    parts.pipeline.stop_pipeline, identity=agent.address, keyring=self._keyring,
                    asking=coordinator.checking))

    async def _serving(self) -> Serving:
        """The ``serving`` answer (``discovery/serving.py``): our node role, the port of our
        router's serving listener (its stats), the identity of the model it serves."""
        stats = await self._supervisor.stats()
        router = stats.get(ROUTER)
        entry = await asyncio.to_thread(model_entry, self._parts.served_model())
        return Serving(role=self._parts.config().serve.node_role,
                       port=port_of(router if isinstance(router, dict) else None),
                       model=entry["identity"] if entry else None)

    async def aclose(self) -> None:
        """Discovery, the heartbeats, the assignee, the coordinator (a push cut short: peers
        abort by deadline), then the agent listener."""
        if self._discovery is not None:
            self._discovery.close()
        if self._heartbeats is not None:
            self._heartbeats.close()
        if self._assignee is not None:
            self._assignee.close()
        if self._healer is not None:
            self._healer.close()
        if self._coordinator is not None:
            self._coordinator.close()
        if self.agent is not None:
            await self.agent.aclose()


def _clock(ts: float) -> str:
    """A time of day for a problem's message (the JSON carries the unix time)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
