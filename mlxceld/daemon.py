"""The composition root: wires state, supervisor and control API; owns signals and shutdown.

Start-up order: private umask, state dir (0700), lock, database, keyring and
the cluster secret, control socket, supervisor (re-adopting what survived a
previous daemon), control API; then READY=1 to a service manager that asked for
it (NOTIFY_SOCKET; see mlxceld.sdnotify for what else is said, and when).

The cluster secret (PROTOCOL.md section 1): a secret from --cluster-secret-file,
MLXCEL_CLUSTER_SECRET_FILE, MLXCEL_CLUSTER_SECRET or the cluster TOML is
installed into the keyring as its primary and so persisted (a 0600 file under
``<state-dir>/keys``): a restart without the flag or variable keeps it, and
`mlxctl secret list` shows it. MLXCEL_CLUSTER_SECRET is dropped from our own
environment once read; workers never get any *SECRET* variable anyway.

Shutdown order, written once (``_shutdown``): stop admitting work, ask every
worker to stop (each has its stop timeout, then SIGKILL from its lifecycle),
a backstop deadline of the longest stop timeout plus ``SHUTDOWN_SLACK_S``
after which every group is SIGKILLed, then close the control API, remove the
socket, close the database, release the lock. A second SIGTERM/SIGINT while
shutting down forces: SIGKILL to every worker group and exit 1.

Signal handlers only enqueue (SIGTERM, SIGINT: stop; SIGHUP: reload).

With a cluster secret the agent listener runs, and with it discovery, the
``Coordinator`` (``cluster/coordinator.py``: `mlxctl cluster plan|activate`,
``--pp-auto``) and the ``Assignee`` over a ``LocalStageHost``
(``cluster/assignment/stagehost.py``); the daemon is their window on its placement and
supervisor (``serve_pipeline``, ``set_stage``, ``reconcile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from mlxceld import __version__
from mlxceld.cluster.assignment.peer import Assignee
from mlxceld.cluster.assignment.push import serve_queries
from mlxceld.cluster.assignment.stagehost import LocalStageHost
from mlxceld.cluster.clusterfile.placement import Placement, place
from mlxceld.cluster.coordinator import RESUMABLE, Coordinator
from mlxceld.config.daemon import Config, Overrides, load_config
from mlxceld.config.secrets import ENV_VALUE, resolve_secret
from mlxceld.config.secrets import FLAG as SECRET_FLAG
from mlxceld.config.serve import ROUTER, ServeConfig, read_api_key, resolve_model
from mlxceld.control.app import build_app
from mlxceld.control.server import (
    ControlServer,
    bind_control_socket,
    check_socket_path,
    peer_guard,
    remove_socket_file,
)
from mlxceld.discovery.candidates import CandidateTable
from mlxceld.discovery.inventory import serve_inventory
from mlxceld.discovery.service import DiscoveryService
from mlxceld.errors import ConfigError, DaemonError
from mlxceld.net.agent import AgentService
from mlxceld.roster import Situation, draw_roster
from mlxceld.sdnotify import Notifier, status_line
from mlxceld.state import (
    SCHEMA_VERSION,
    EventLog,
    KeyStore,
    PeersTable,
    Settings,
    WorkersTable,
    claim_node,
    open_db,
    parse_key_id,
)
from mlxceld.state.lock import StateLock, acquire
from mlxceld.state.plans import Assignments, Plans
from mlxceld.supervisor import health
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import JSON
from mlxceld.wire.address import parse_address

log = logging.getLogger(__name__)

SHUTDOWN_SLACK_S = 5.0


def prepare_state_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
        if st.st_uid != os.geteuid():
            raise DaemonError(f"state dir {path} belongs to uid {st.st_uid}, not to us "
                              f"(uid {os.geteuid()})",
                              hint="run mlxceld as its owner, or pick another --state-dir")
        os.chmod(path, 0o700)
    except OSError as exc:
        raise DaemonError(f"state dir {path} cannot be used: {exc.strerror}",
                          hint="check the path and its permissions, or pick another --state-dir"
                          ) from exc


class Daemon:
    def __init__(self, config: Config, flags: Overrides) -> None:
        self.config = config
        self._flags = flags
        self._commands: asyncio.Queue[str] = asyncio.Queue()
        self._stopping = False
        self._started_at = time.time()
        self._notify = Notifier.from_environment()  # systemd's NOTIFY_SOCKET; else a no-op
        os.umask(0o077)
        check_socket_path(config.socket)
        prepare_state_dir(config.state_dir)
        self._lock: StateLock = acquire(config.state_dir)
        try:
            self._db = open_db(config.state_dir / "state.db")
            self.node = claim_node(self._db)
            self.events = EventLog(self._db)
            self.events.trim()
            self.settings = Settings(self._db)
            self.keys = KeyStore(self._db, config.state_dir / "keys")
            self.candidates = CandidateTable(PeersTable(self._db), node_id=self.node.node_id)
            self.placement = (place(config.distributed_config, config.node_id or "",
                                    config.serve.model)  # --model or [serve] model wins
                              if config.distributed_config else None)
            self._adopt_secret()
            self._api_key = (read_api_key(config.serve.api_key_file)
                             if config.serve.api_key_file else None)
            self._serve = self._effective_serve(config.serve)
            self._check_cluster_secret()
            self.supervisor = Supervisor(
                WorkersTable(self._db), self.events,
                health_interval_s=config.health_interval_s,
                log_max_bytes=config.log_max_bytes, log_backups=config.log_backups)
            self._sock = bind_control_socket(config.socket, config.socket_group)
        except BaseException:
            self._lock.release()
            raise
        self._socket_group = config.socket_group  # a reload changes it at the next start
        self._server = ControlServer(peer_guard(build_app(self), config.socket_group,
                                                config.socket), self._sock)
        agent = parse_address(config.agent_addr, port_zero=True)  # checked by the config
        self._agent_addr = (agent.host, agent.port)
        self._agent: AgentService | None = None
        self._agent_error: str | None = None
        self._discovery: DiscoveryService | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._plans = Plans(self._db)
        self._assignments = Assignments(self._db)
        self._assignee: Assignee | None = None
        self._standby = False  # the stage worker starts in standby (a prepared assignment)
        self._coordinator: Coordinator | None = None
        # No single-host router while a pipeline is to come (pp_auto, or a plan to resume at
        # start), or after `mlxctl cluster deactivate`, until `mlxctl serve` says otherwise.
        self._hold_router = config.pp_auto is not None or self._resumes_a_plan()

    # -- DaemonView (the control API's window on us) --------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    def status(self) -> JSON:
        workers = self.supervisor.snapshot()
        return {
            "daemon": {
                "pid": os.getpid(), "version": __version__, "node_id": self.node.node_id,
                "hostname": self.node.hostname, "started_at": self._started_at,
                "uptime_s": round(time.time() - self._started_at, 3),
                "state": "stopping" if self._stopping else "running",
                "state_dir": str(self.config.state_dir), "socket": str(self.config.socket),
                "socket_group": self._socket_group.name if self._socket_group else None,
                "config_file": str(self.config.config_file) if self.config.config_file else None,
                "schema_version": SCHEMA_VERSION,
            },
            "serving": self._serving(),
            "cluster": self.placement.describe() if self.placement else None,
            "assignment": self._assignee.describe() if self._assignee else None,
            "bringup": self._coordinator.state if self._coordinator else None,
            "agent": {"address": self._agent.address if self._agent else None,
                      "error": self._agent_error if not self._agent else None,
                      "keys": len(self.keys.keyring)},
            "workers": workers,
            "problems": health.problems(workers),
        }

    def workers(self) -> list[JSON]:
        return self.supervisor.snapshot()

    def cluster_nodes(self) -> JSON:
        c = self.config
        discovery = (self._discovery.describe() if self._discovery else
                     {"mode": c.cluster_discovery, "running": False, "address": None,
                      "advertised": None, "error": None if len(self.keys.keyring) else
                      "no cluster secret: discovery runs with the agent listener"})
        return {"cluster": c.cluster_name, "node_id": self.node.node_id,
                "discovery": discovery, "nodes": self.candidates.snapshot()}

    async def plan_cluster(self, model: str, stages: int) -> JSON:
        """`mlxctl cluster plan` (``Coordinator.plan``). Assigns nothing."""
        return await self._coordinating().plan(model, stages)

    async def activate_cluster(self, model: str, stages: int) -> JSON:
        """`mlxctl cluster activate` (``Coordinator.activate``): plans now, pushes and
        serves in our task group; the answer carries the plan's epoch."""
        coordinator = self._pushing_plans("activate")
        if self._stopping or self._tg is None:
            raise DaemonError("the daemon is shutting down and starts no bring-up",
                              hint="start it again, then activate")
        return await coordinator.activate(model, stages)

    async def deactivate_cluster(self) -> JSON:
        """`mlxctl cluster deactivate` (``Coordinator.deactivate``): end the plan on every
        peer and stop our router; the daemon stays up."""
        state = await self._pushing_plans("deactivate").deactivate()
        if self.config.pp_auto is not None:
            state = {**state, "note": f"pp_auto {self.config.pp_auto} is set: the next start "
                     "of this daemon plans and pushes a new plan; remove pp_auto (--pp-auto, "
                     "[daemon] pp_auto) to keep the cluster down"}
        return state

    def _pushing_plans(self, command: str) -> Coordinator:
        """The coordinator, for `mlxctl cluster activate|deactivate`: refused on a daemon
        that takes stages (--pp-peer) or runs a written cluster (--distributed-config)."""
        coordinator = self._coordinating()
        if self.config.pp_peer:
            raise ConfigError("this daemon runs with --pp-peer: it takes stages, it does not "
                              "push plans",
                              hint=f"run mlxctl cluster {command} on the coordinator, a "
                              "daemon without --pp-peer")
        if self.config.distributed_config is not None:
            raise ConfigError(f"this daemon runs the cluster config "
                              f"{self.config.distributed_config} (--distributed-config), "
                              "which no plan of its own placed",
                              hint=f"start it without --distributed-config to {command} a "
                              "plan; a written cluster stops with its daemons")
        return coordinator

    def _coordinating(self) -> Coordinator:
        if self._coordinator is None:
            raise ConfigError("planning needs discovery, which runs with the agent listener "
                              "once the daemon has a cluster secret",
                              hint="install one: mlxctl secret install FILE --primary")
        return self._coordinator

    async def _dry_run(self) -> int:
        model = self._serve.model
        if self._coordinator is None or model is None:
            print("mlxceld: error: --pp-auto needs a cluster secret and --model DIR",
                  file=sys.stderr)
            return 2
        return await self._coordinator.dry_run(self.config.pp_auto or 0, model)

    # -- the coordinator's and the stage host's window on us -------------------------------

    async def stop_pipeline(self) -> None:
        """The plan is deactivated: no placement, no router (not even a single-host one on
        the configured model) until `mlxctl serve`, an activate, or a restart."""
        self.placement = None
        self._hold_router = True
        await self.reconcile()

    async def serve_pipeline(self, placement: Placement) -> None:
        """Run the router over the pushed plan: on its model, restarted if it was serving."""
        self.placement = placement
        model = str(placement.model)
        if self._serve.model != model:
            self._serve = self._serve.with_model(model)
        existed = ROUTER in self.supervisor.names()
        await self.reconcile()
        if existed:
            self.supervisor.restart(ROUTER)

    def set_stage(self, placement: Placement | None, *, standby: bool) -> None:
        self.placement, self._standby = placement, standby

    async def reconcile(self) -> None:
        await self.supervisor.reconcile(self.specs(self.config))

    def log_path(self, name: str) -> str | None:
        return self.supervisor.log_path(name)

    async def worker_stats(self) -> dict[str, JSON]:
        return await self.supervisor.stats()

    def restart_worker(self, name: str) -> None:
        self.supervisor.restart(name)

    def request_stop(self) -> None:
        self._commands.put_nowait("stop")

    def secrets(self) -> list[JSON]:
        return [k.to_json() for k in self.keys.list()]

    def install_secret(self, secret: bytes, primary: bool, source: str) -> JSON:
        info = self.keys.install(secret, source=source, primary=primary)
        self.events.append("secret.installed", "keyring",
                           f"cluster secret {info.key_id} installed ({info.state})",
                           key_id=info.key_id)
        if self._agent is None:
            self._commands.put_nowait("agent")  # the first secret: start the agent listener
        return info.to_json()

    def use_secret(self, kid: str) -> JSON:
        info = self.keys.set_primary(parse_key_id(kid))
        self.events.append("secret.primary", "keyring",
                           f"cluster secret {info.key_id} is now the primary", key_id=info.key_id)
        return info.to_json()

    def remove_secret(self, kid: str) -> JSON:
        info = self.keys.remove(parse_key_id(kid))
        self.events.append("secret.removed", "keyring", f"cluster secret {info.key_id} removed",
                           key_id=info.key_id)
        return info.to_json()

    # -- lifetime -------------------------------------------------------------------------

    def specs(self, config: Config) -> list[WorkerSpec]:
        """The workers to run now: ``roster.draw_roster`` of ``config`` and our state."""
        return draw_roster(Situation(
            config, self._serve, self.placement, standby=self._standby,
            hold_router=self._hold_router,
            secret=self.keys.keyring.primary if len(self.keys.keyring) else None,
            api_key=self._api_key))

    def _may_coordinate(self) -> bool:
        """A peer or a node of a written cluster never resumes a plan of its own."""
        return not self.config.pp_peer and self.config.distributed_config is None

    def _resumes_a_plan(self) -> bool:
        """Whether the latest plan is to be resumed at start (``coordinator.RESUMABLE``)."""
        last = self._plans.latest()
        if last is None or last.decision not in RESUMABLE:
            return False
        if self._may_coordinate():
            return True
        log.warning("plan %d (%s) is not resumed: this daemon now runs with %s", last.epoch,
                    last.decision, "pp_peer" if self.config.pp_peer else "distributed_config")
        return False

    def _adopt_secret(self) -> None:
        """Resolve the cluster secret; one from a flag, variable or file becomes the primary."""
        toml = self.placement.cluster.secret_source() if self.placement else None
        c = self.config
        from_flag = c.cluster_secret_origin == SECRET_FLAG
        resolved = resolve_secret(flag_file=c.cluster_secret_file if from_flag else None,
                                  config_file=None if from_flag else c.cluster_secret_file,
                                  toml=toml, keyring=self.keys.keyring,
                                  keyring_where=str(self.keys.dir))
        os.environ.pop(ENV_VALUE, None)
        if resolved is None:
            log.info("no cluster secret yet (see mlxctl secret --help); single-node use only")
            return
        if resolved.from_keyring:
            log.info("cluster secret: %s", resolved.source)
            return
        info = self.keys.install(resolved.secret, source=resolved.source, primary=True)
        self.events.append("secret.adopted", "keyring",
                           f"cluster secret {info.key_id} from {resolved.source} is the primary",
                           key_id=info.key_id)
        log.info("cluster secret %s from %s is the primary (kept in %s)", info.key_id,
                 resolved.source, self.keys.dir)

    def _check_cluster_secret(self) -> None:
        """Fail closed: a pipeline of two or more stages never runs without the secret."""
        if self.config.pp_auto is not None and not len(self.keys.keyring):
            raise ConfigError(
                "--pp-auto needs the cluster secret to reach its peers; none was found in "
                "--cluster-secret-file, MLXCEL_CLUSTER_SECRET_FILE, MLXCEL_CLUSTER_SECRET, "
                f"[daemon] cluster_secret_file or the keyring in {self.keys.dir}",
                hint="give every node the same secret file with --cluster-secret-file")
        if self.config.pp_auto is not None and self._serve.model is None:
            raise ConfigError("--pp-auto needs the model to plan: pass --model DIR",
                              hint="the same checkpoint must be on every host")
        p = self.placement
        if p is None or not p.needs_secret or len(self.keys.keyring):
            return
        raise ConfigError(
            f"cluster config {p.cluster.path} has {len(p.cluster.stages)} stages and needs the "
            "cluster secret; none was found in --cluster-secret-file, "
            "MLXCEL_CLUSTER_SECRET_FILE, MLXCEL_CLUSTER_SECRET, [daemon] cluster_secret_file, "
            f"[cluster] secret_file or the keyring in {self.keys.dir}",
            hint="give every node the same secret: mlxctl secret generate FILE, copy FILE "
            "(chmod 600) to each host, then pass --cluster-secret-file FILE")

    def _effective_serve(self, configured: ServeConfig) -> ServeConfig:
        """Flags and the config file win; else what `mlxctl serve` chose last time.
        A cluster coordinator serves its cluster's model."""
        if self.placement is not None:
            return configured.with_model(str(self.placement.model), configured.model_name)
        saved = self.settings.get("serve")
        if configured.model is None and saved is not None:
            return configured.with_model(saved["model"], saved.get("model_name"))
        return configured

    async def serve_model(self, model: str, name: str | None) -> JSON | None:
        """`mlxctl serve`: validate, remember, and (re)start the router on the new model."""
        if self.placement is not None:
            raise ConfigError(
                f"this daemon is node {self.placement.node.id!r} of cluster config "
                f"{self.placement.cluster.path}; it serves that cluster's model",
                hint="change [cluster] model in that file on every node, then restart them")
        resolved = resolve_model(model, Path("/"), "mlxctl serve")
        self._serve = self._serve.with_model(resolved, name)
        self._hold_router = False  # told to serve: also after a deactivate
        self.settings.put("serve", {"model": resolved, "model_name": name})
        existed = ROUTER in self.supervisor.names()
        await self.supervisor.reconcile(self.specs(self.config))
        if existed:
            self.supervisor.restart(ROUTER)
        self.events.append("serve.changed", ROUTER,
                           f"now serving {self._serve.served_name} from {resolved}")
        return self._serving()

    async def unserve(self) -> JSON:
        """`mlxctl unserve`: stop the single-host router and forget what `mlxctl serve`
        chose, so that a restart does not serve it again. Refused, changing nothing, where
        a restart would serve again anyway (a model from the flags or the config file) or
        where the router is a cluster's."""
        p = self.placement
        if p is not None and p.is_coordinator:
            raise ConfigError("this daemon's router serves a pipeline",
                              hint="mlxctl cluster deactivate ends the plan and stops its "
                              "router" if self.config.distributed_config is None else
                              f"it runs the cluster config {p.cluster.path}; stop the daemon")
        if p is not None:
            raise ConfigError(f"this daemon runs {p.node.id} of a cluster and no router",
                              hint="on the coordinator: mlxctl cluster deactivate")
        configured = self.config.serve.model
        if configured is not None:
            origin = ("--model" if self._flags.model else
                      f"[serve] model in {self.config.config_file}")
            raise ConfigError(f"the model {configured} comes from {origin}: a restart would "
                              "serve it again, so it is not unserved",
                              hint="remove it there, then reload (systemctl reload mlxceld, "
                              "or SIGHUP) or restart; then mlxctl unserve forgets what "
                              "mlxctl serve chose, if anything")
        was = self._serving()
        self.settings.delete("serve")
        self._serve = replace(self._serve, model=None, model_name=None)
        await self.supervisor.reconcile(self.specs(self.config))
        if was is not None:
            self.events.append("serve.stopped", ROUTER,
                               f"no longer serving {was['model_name']} ({was['model']})")
            log.info("no longer serving %s (mlxctl unserve)", was["model"])
        return {"unserved": was}

    def _serving(self) -> JSON | None:
        s = self._serve
        if s.model is None or (self._hold_router and self.placement is None):
            return None  # nothing, or a router held back (see ``specs``)
        return {"model": s.model, "model_name": s.served_name,
                "url": f"http://{s.host}:{s.port}/v1", "api_key": s.api_key_file is not None}

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig, command in ((signal.SIGTERM, "stop"), (signal.SIGINT, "stop"),
                             (signal.SIGHUP, "reload")):
            loop.add_signal_handler(sig, self._commands.put_nowait, command)
        try:
            async with asyncio.TaskGroup() as tg:
                sup_started: asyncio.Future[None] = loop.create_future()
                tg.create_task(self.supervisor.run(sup_started))
                await sup_started
                srv_started: asyncio.Future[None] = loop.create_future()
                tg.create_task(self._server.serve(srv_started))
                await srv_started
                specs = self.specs(self.config)
                await self.supervisor.reconcile(specs)
                self.events.append("daemon.started", "daemon",
                                   f"mlxceld {__version__} started (pid {os.getpid()})",
                                   pid=os.getpid())
                log.info("mlxceld %s ready: node %s, control socket %s, %d worker(s)",
                         __version__, self.node.node_id, self.config.socket, len(specs))
                self._tg = tg
                if len(self.keys.keyring):
                    await self._start_agent()
                self._notify.ready(status_line(self.status()))
                tg.create_task(self._notify.run(lambda: status_line(self.status())))
                code = await (self._dry_run() if self.config.dry_run
                              else self._serve_commands())
                if self._discovery is not None:
                    self._discovery.close()
                if self._assignee is not None:
                    self._assignee.close()
                if self._coordinator is not None:
                    self._coordinator.close()  # a push cut short: peers abort by deadline
                if self._agent is not None:
                    await self._agent.aclose()
                self._server.request_shutdown()
                self.supervisor.close()
                self._notify.close()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            self._close()
        log.info("mlxceld stopped")
        return code

    async def _serve_commands(self) -> int:
        while True:
            command = await self._commands.get()
            if command == "reload":
                self._notify.reloading()
                await self._reload()
                self._notify.ready(status_line(self.status()))
                continue
            if command == "agent":
                await self._start_agent()
                continue
            return await self._shutdown()

    async def _start_agent(self) -> None:
        """The MXCL agent listener, whenever there is a cluster secret; a bind failure is
        reported (log, event, status) and leaves the daemon running single-host."""
        if self._agent is not None or self._tg is None or self._stopping:
            return
        agent = AgentService(self._agent_addr, self.keys.keyring)
        serve_inventory(agent, self.node.node_id, lambda: self._serve.model,
                        self.config.stage_ports)
        serve_queries(agent, self._plans)
        c = self.config
        stages = LocalStageHost(self, self.supervisor, self.events, cluster=c.cluster_name,
                                state_dir=c.state_dir, model=lambda: self._serve.model,
                                agent_host=lambda: agent.host, stage_ports=c.stage_ports)
        assignee = Assignee(self._assignments, stages, self.keys.keyring,
                            identity=lambda: agent.address, state_dir=self.config.state_dir,
                            enabled=self.config.pp_peer)
        assignee.register(agent)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                await agent.run(started)
            except OSError as exc:
                self._agent_error = (f"cannot listen on {self._agent_addr[0]}:"
                                     f"{self._agent_addr[1]}: {exc.strerror}")
                if self._hold_router and self.placement is None:
                    self._agent_error += ("; no pipeline is brought up or resumed without it "
                                          "(restart the daemon once the address is free)")
                log.error("agent listener: %s", self._agent_error)
                self.events.append("agent.failed", "agent", self._agent_error)
                self._agent = None
                if not started.done():
                    started.set_result(None)

        self._agent = agent
        self._tg.create_task(run())
        await started
        if self._agent is not None:
            self._agent_error = None
            self.events.append("agent.listening", "agent",
                               f"agent listener on {agent.address}", address=agent.address)
            self._discovery = DiscoveryService(
                self.candidates, self.keys.keyring, node_id=self.node.node_id,
                cluster=c.cluster_name, peers=c.cluster_peers, mode=c.cluster_discovery,
                agent_address=agent.address)
            self._tg.create_task(self._discovery.run())
            self._coordinator = Coordinator(
                self, self._tg, cluster=c.cluster_name, state_dir=c.state_dir,
                config_out=c.cluster_config_out, plans=self._plans, keyring=self.keys.keyring,
                discovery=self._discovery, identity=agent.address, events=self.events)
            self._assignee = assignee
            self._tg.create_task(assignee.run())
            if not c.dry_run and self._may_coordinate():
                self._coordinator.start(c.pp_auto, self._serve.model,
                                        configured_model=c.serve.model)

    async def _shutdown(self) -> int:
        self._stopping = True
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._force)
        self.events.append("daemon.stopping", "daemon", "mlxceld is shutting down")
        log.info("shutting down: stopping %d worker(s)", len(self.supervisor.names()))
        longest = self.supervisor.longest_stop_timeout()
        self._notify.stopping(longest + SHUTDOWN_SLACK_S, len(self.supervisor.names()))
        try:
            async with asyncio.timeout(longest + SHUTDOWN_SLACK_S):
                await self.supervisor.stop_all()
        except TimeoutError:
            log.warning("workers still running after %.0f s: SIGKILL to every worker group",
                        longest + SHUTDOWN_SLACK_S)
            self.supervisor.kill_all()
            self.events.append("daemon.forced_stop", "daemon", "forced stop at the deadline")
            return 1
        self.events.append("daemon.stopped", "daemon", "mlxceld stopped cleanly")
        return 0

    def _force(self) -> None:
        """A second SIGTERM/SIGINT while shutting down: kill every worker group, exit now."""
        log.warning("second signal: forcing shutdown, SIGKILL to every worker group")
        self.supervisor.kill_all()
        self._close()
        os._exit(1)

    async def _reload(self) -> None:
        """SIGHUP: re-read the config file and reopen log files; never restart workers."""
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.close()  # reopened on the next record
        try:
            new = load_config(self._flags)
        except ConfigError as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            self.events.append("daemon.reload_failed", "daemon", f"reload failed: {exc}")
            return
        for field in ("state_dir", "socket", "socket_group"):
            if getattr(new, field) != getattr(self.config, field):
                log.warning("reload: %s changed; it takes effect at the next start", field)
        logging.getLogger().setLevel(new.log_level.upper())
        self.config = new
        self._serve = self._effective_serve(new.serve)
        self.events.append("daemon.reloaded", "daemon", "configuration reloaded")
        log.info("configuration reloaded")
        await self.supervisor.reconcile(self.specs(new))

    def _close(self) -> None:
        remove_socket_file(self.config.socket)
        with contextlib.suppress(Exception):
            self._sock.close()
        with contextlib.suppress(Exception):
            self._db.close()
        self._lock.release()


async def serve(config: Config, flags: Overrides) -> int:
    return await Daemon(config, flags).run()
