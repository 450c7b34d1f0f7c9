"""The composition root: wires state, supervisor and control API; owns signals and shutdown.

Start-up order: private umask, state dir (0700), lock, database, keyring and
the cluster secret, control socket, supervisor (re-adopting what survived a
previous daemon), control API; then READY=1 to a service manager that asked for
it (NOTIFY_SOCKET; see mlxceld.sdnotify for what else is said, and when).

The cluster secret (PROTOCOL.md section 1) is the ``KeyringService``'s
(``cluster/keyring.py``): adopted at start (a secret from a flag, a variable or
a TOML becomes the primary, kept in a 0600 file under ``<state-dir>/keys``),
required where a pipeline runs, changed by `mlxctl secret`. Its first secret
starts the agent listener. Workers never get any *SECRET* variable.

Shutdown order, written once (``_shutdown``, whose last step ``_release`` runs once
every task has ended): stop admitting work (rank 0 of a tensor-parallel group across
hosts forms it no more), ask every worker to stop (each has its stop timeout, then
SIGKILL from its lifecycle), a backstop deadline of the longest stop timeout plus
``SHUTDOWN_SLACK_S`` after which every group is SIGKILLed; then close the cluster member
(discovery, the assignee, the coordinator, the agent listener) and the control API. The
workers drain in parallel, each within its stop timeout (a model worker's is at least
``roster.MODEL_STOP_TIMEOUT_S``, 20 s): a router lets its open streams finish for
``workers.router.GRACEFUL_S`` (10 s), a stage refuses new sequences and runs those it
holds to their end for ``pipeline.stage.DRAIN_S`` (15 s). The member closes only after
them, so heartbeats keep a draining stage's host alive to its coordinator. Then remove
the socket, close the database, release the lock. A second SIGTERM/SIGINT while shutting
down forces (``_force``): SIGKILL to every worker group, ``_release``, exit 1. After a
dry run nothing is drained: it goes straight to the closing.

A worker that exits cleanly on its own stays down, except the stage of an active plan,
which comes back; a failed stage worker's port is answered by a stand-in: both are the
``StageWatch``'s (``stage_watch.py``).

Signal handlers only enqueue (SIGTERM, SIGINT: stop; SIGHUP: reload, which also binds
the control socket again if its file was deleted; ``control/keeper.py`` checks that file
every few seconds as well).

With a cluster secret the ``ClusterMember`` (``cluster/member.py``) runs the agent
listener, and with it discovery, the ``Coordinator`` (`mlxctl cluster
plan|activate`, ``--pp-auto``) and the ``Assignee`` over a ``LocalStageHost``; what they use
of this daemon is handed to it as ``MemberParts``. Which workers run is
the ``Roster``'s (``roster.py``: its inputs and the one reconcile); what the router
serves, with `mlxctl serve|unserve`, is the ``ServingWindow``'s (``serving.py``);
`mlxctl drain|undrain` are the ``DrainWindow``'s (``draining.py``); `mlxctl secret` the
``KeyWindow``'s (``keys.py``); `mlxctl cluster link-test` the ``LinkWindow``'s
(``links.py``).

Each part is handed a record of the parts it uses, never the daemon (as uvicorn hands
its protocols a ``ServerState`` and the config, never its ``Server``): the control API
and /metrics a ``control.view.DaemonView``. Where two parts call each other (the cluster
member and the roster, the key window or the supervisor's stage watch), the later one
is reached through a function made here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Protocol

from mlxceld import __version__
from mlxceld.cluster.clusterfile.placement import (
    place,
    served_node,
    serving_cluster,
    serving_config,
)
from mlxceld.cluster.keyring import KeyringService
from mlxceld.cluster.member import ClusterMember, MemberParts
from mlxceld.config.changes import AT_NEXT_START, api_key_change, config_changes
from mlxceld.config.daemon import Config, Overrides, load_config
from mlxceld.config.replicas import discovers
from mlxceld.config.serve import read_api_key
from mlxceld.config.tensor import across_hosts
from mlxceld.control.answers import Reloaded
from mlxceld.control.app import build_app
from mlxceld.control.keeper import SocketKeeper, holder_hint
from mlxceld.control.server import (
    ControlServer,
    bind_control_socket,
    check_socket_path,
    peer_guard,
    remove_socket_file,
)
from mlxceld.control.view import DaemonView, Lifetime
from mlxceld.daemon.draining import DrainParts, DrainWindow, drained_nodes
from mlxceld.daemon.following import PlanFollower
from mlxceld.daemon.keys import KeyWindow
from mlxceld.daemon.links import LinkParts, LinkWindow
from mlxceld.daemon.replica_peers import ReplicaPeers
from mlxceld.daemon.roster import Roster
from mlxceld.daemon.serving import ServingParts, ServingWindow
from mlxceld.daemon.stage_watch import StageWatch, StageWatchParts
from mlxceld.daemon.standby import Standby
from mlxceld.daemon.tensor_peers import TensorWindow
from mlxceld.discovery.candidates import CandidateTable
from mlxceld.discovery.speed import NodeSpeed
from mlxceld.errors import AlreadyRunning, ConfigError, MlxceldError
from mlxceld.observe import MetricsServer
from mlxceld.sdnotify import Notifier, status_line
from mlxceld.state import (
    SCHEMA_VERSION,
    STATE_DB,
    DrainsTable,
    KeyStore,
    LivenessTable,
    PeersTable,
    RotationsTable,
    Settings,
    WorkersTable,
    state_errors,
)
from mlxceld.state.lock import StateLock, acquire, prepare_state_dir
from mlxceld.state.plans import Assignments, Plans
from mlxceld.state.startup import start_state
from mlxceld.supervisor import health
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import HANDOFF_SIDES, JSON, ROUTER_ROLE

log = logging.getLogger("mlxceld.daemon")  # the room's name, as journal lines have read it


SHUTDOWN_SLACK_S = 5.0


class Terminal(Protocol):
    """The terminal that started the daemon, for what it says there (``--dry-run``'s plan);
    the CLI's edge renders it (``mlxceld.cli``)."""

    def say(self, text: str) -> None: ...
    def error(self, exc: MlxceldError) -> None: ...


class Daemon:
    """The composition root: it makes the parts, hands each a record of the others it uses
    (never itself), and owns the signals, the commands and the one shutdown order."""

    def __init__(self, config: Config, flags: Overrides, terminal: Terminal) -> None:
        config = serving_config(config, flags)  # a serving cluster file's node: its flags
        self._flags = flags
        self._terminal = terminal
        self._commands: asyncio.Queue[str | asyncio.Future[Reloaded]] = asyncio.Queue()
        self._stopping = False
        self._started_at = time.time()
        self._notify = Notifier.from_environment()  # systemd's NOTIFY_SOCKET; else a no-op
        os.umask(0o077)
        check_socket_path(config.socket)
        prepare_state_dir(config.state_dir)
        try:
            self._lock: StateLock = acquire(config.state_dir, config.socket)
        except AlreadyRunning as exc:  # the hint depends on whether its socket answers
            raise AlreadyRunning(exc.message, hint=holder_hint(exc.pid, exc.socket),
                                 pid=exc.pid, socket=exc.socket) from None
        try:
            with state_errors(config.state_dir / STATE_DB):
                self._start(config)
        except BaseException:
            self._lock.release()
            raise
        self._socket_group = config.socket_group  # a reload changes it at the next start
        self._server = ControlServer(peer_guard(build_app(self._view), config.socket_group,
                                                config.socket), self._sock)
        self._keeper = SocketKeeper(self._server, config.socket, config.socket_group,
                                    self._socket_event)
        # No single-host router while a pipeline is to come (pp_auto, or a plan to resume at
        # start), or after `mlxctl cluster deactivate`, until `mlxctl serve` says otherwise.
        self.roster.hold_router = config.pp_auto is not None or self.member.resumes_a_plan()
        resumed = self.member.resumed_placement() if self.roster.placement is None else None
        if resumed is not None:  # its router, if it still runs, is re-adopted
            self.serving.resume_placement(resumed)

    def _start(self, config: Config) -> None:
        """The start-up under the lock: state, keyring, supervisor, the control socket."""
        state = start_state(config.state_dir / STATE_DB, reset=config.reset_state)
        self._db, self.node, self.events = state.db, state.node, state.events
        self.keys = KeyringService(KeyStore(self._db, config.state_dir / "keys"),
                                   self.events, on_install=self._secret_installed)
        served = serving_cluster(config)  # a serving cluster's node has no placement
        placement = (place(config.distributed_config, config.node_id or "",
                           config.serve.model)  # --model or [serve] model wins
                     if config.distributed_config and served is None else None)
        self.keys.adopt(config, placement, served.secret_source() if served else None)
        self._stage = StageWatch(self.keys.keyring, self.node.node_id)
        api_key = read_api_key(config.serve.api_key_file) if config.serve.api_key_file else None
        self.supervisor = Supervisor(  # nothing runs before its run(): made here, idle
            WorkersTable(self._db), self.events,
            health_interval_s=config.health_interval_s,
            log_max_bytes=config.log_max_bytes, log_backups=config.log_backups,
            finished=self._stage.finished, changed=self._stage.changed)
        self.roster = Roster(config, self.supervisor, self.keys.keyring, placement=placement,
                             node_id=self.node.node_id, api_key=api_key,
                             agent_address=lambda: self.member.agent_address())
        self._stage.watch(StageWatchParts(self.supervisor, self.roster, lambda: self._stopping))
        self.serving = ServingWindow(ServingParts(self.roster, self.supervisor,
                                                  Settings(self._db), self.events, self._flags),
                                     config.serve)  # what the router serves
        role = config.serve.node_role
        self.keys.require(pp_auto=config.pp_auto is not None, placement=placement,
                          router=role == ROUTER_ROLE,
                          handoff_side=role if role in HANDOFF_SIDES else None,
                          tensor=across_hosts(role, config.serve.tp_peers),
                          served=served_node(served, config.node_id or "")
                          if served is not None else None)
        self.serving.check_start(config)  # the model: fetched, split over --tp-size, ...
        self._make_parts()
        self._metrics = None if config.metrics_listen is None else MetricsServer(
            self._view, config.metrics_listen, lambda: self.roster.api_key,
            lambda: self.roster.config.serve.metrics_require_key)  # [daemon] metrics_listen
        self._sock = bind_control_socket(config.socket, config.socket_group)

    def _make_parts(self) -> None:
        """The cluster member, the key and drain windows, the replica peers, and the record
        of parts the control API and /metrics are handed (``control.view.DaemonView``)."""
        candidates = CandidateTable(PeersTable(self._db), node_id=self.node.node_id)
        self.speed = NodeSpeed(Settings(self._db), declared=self._declared_units,
                               model=lambda: self.roster.serve.model)  # discovery/speed.py
        drains = DrainsTable(self._db)
        keys = KeyWindow(self.keys, self.supervisor, self.events,
                         keyring_changed=lambda: self.member.keyring_changed())
        self.tensor = TensorWindow(self.roster, self.supervisor, self.keys.keyring, self.events,
                                   lambda: self.member.agent_address())  # across hosts
        self.member = ClusterMember(
            MemberParts(config=lambda: self.roster.config, stopping=lambda: self._stopping,
                        served_model=lambda: self.roster.serve.model,
                        router_held=self.roster.router_held,
                        drained_nodes=lambda: drained_nodes(drains), pipeline=self.serving,
                        stage=self.tensor.stage, keys=keys,
                        served_pipeline=self.roster.served_pipeline,
                        fronts=self.serving.fronts, units=self.speed.units,
                        more=self.tensor.register),
            self.supervisor, self.events, self.keys.keyring, node_id=self.node.node_id,
            candidates=candidates, plans=Plans(self._db), assignments=Assignments(self._db),
            liveness=LivenessTable(self._db), rotations=RotationsTable(self._db),
            settings=Settings(self._db))
        self._draining = DrainWindow(DrainParts(self.roster, self.node.node_id, self.supervisor,
                                                self.member), drains, self.events)
        self._replica_peers = ReplicaPeers(candidates, self.supervisor, self._finds_replicas)
        self._front = PlanFollower(self.roster, self.supervisor, self.events, self.keys.keyring,
                                   Settings(self._db), origin=self.member.agent_address)
        self._standby = Standby(self._front, self.member.adopt, self.events,
                                dead_after_s=lambda: self.roster.config.liveness.dead_after_s
                                ) if self.roster.serve.standby else None
        self._view = DaemonView(
            self.events, Lifetime(lambda: self._stopping, self.status, self.request_stop,
                                  self.reload),
            self.supervisor, self.member, keys, self.serving, self._draining,
            LinkWindow(LinkParts(self.member.agent_address, lambda: self.member.nodes().nodes,
                                 self.keys.keyring)))

    def _declared_units(self) -> float | None:
        """[daemon] compute_units, else this node's in its cluster TOML; None: measure."""
        placement = self.roster.placement
        return (self.roster.config.compute_units
                or (placement.node.compute_units if placement else None) or None)

    # -- the daemon's own, in the control API's view (``Lifetime``) ------------------------

    def status(self) -> JSON:
        workers = [w.to_json() for w in self.supervisor.snapshot()]
        served = self.serving.describe()
        config, placement = self.roster.config, self.roster.placement
        return {
            "daemon": {
                "pid": os.getpid(), "version": __version__, "node_id": self.node.node_id,
                "hostname": self.node.hostname, "started_at": self._started_at,
                "uptime_s": round(time.time() - self._started_at, 3),
                "state": "stopping" if self._stopping else "running",
                "state_dir": str(config.state_dir), "socket": str(config.socket),
                "socket_group": self._socket_group.name if self._socket_group else None,
                "config_file": str(config.config_file) if config.config_file else None,
                "log_level": config.log_level,
                "schema_version": SCHEMA_VERSION,
                "compute_units": self.speed.describe(),  # discovery/speed.py
            },
            "serving": served.to_json() if served else None,
            "cluster": placement.describe() if placement else None,
            **self.member.describe(),  # assignment, bringup, agent
            "front": self._front.describe(),  # a router in front of a pipeline: following.py
            "standby": self._standby.describe() if self._standby else None,  # standby.py
            "tensor": self.tensor.describe(),  # a tensor group across hosts: tensor_peers.py
            "workers": workers,
            "problems": health.problems(workers) + self.member.problems(),
        }

    def request_stop(self) -> None:
        self._commands.put_nowait("stop")

    async def reload(self) -> Reloaded:
        """`mlxctl reload`: SIGHUP's reload, queued as SIGHUP queues it; what it changed,
        or the ``ConfigError`` that kept the running config."""
        answer: asyncio.Future[Reloaded] = asyncio.get_running_loop().create_future()
        self._commands.put_nowait(answer)
        return await answer

    def _secret_installed(self) -> None:
        if self.member.agent is None:
            self._commands.put_nowait("agent")  # the first secret: start the agent listener

    # -- lifetime -------------------------------------------------------------------------

    async def _dry_run(self) -> int:
        """``--pp-auto N --dry-run``: the plan, or why there is none, on the terminal (exit
        2 for a config error, as the CLI's edge does, 1 for any other failure)."""
        try:
            self._terminal.say(await self.member.dry_run())
        except ConfigError as exc:
            self._terminal.error(exc)
            return 2
        except MlxceldError as exc:
            self._terminal.error(exc)
            return 1
        return 0

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig, command in ((signal.SIGTERM, "stop"), (signal.SIGINT, "stop"),
                             (signal.SIGHUP, "reload")):
            loop.add_signal_handler(sig, self._commands.put_nowait, command)
        try:
            async with asyncio.TaskGroup() as tg:
                sup_started: asyncio.Future[None] = loop.create_future()
                tg.create_task(self._stage.run())
                tg.create_task(self.supervisor.run(sup_started))
                await sup_started
                srv_started: asyncio.Future[None] = loop.create_future()
                tg.create_task(self._server.serve(srv_started))
                await srv_started
                tg.create_task(self._keeper.run())
                tg.create_task(self._draining.service.run())
                tg.create_task(self._replica_peers.run())
                tg.create_task(self.tensor.run())
                tg.create_task(self._front.run())
                if self._standby is not None:
                    tg.create_task(self._standby.run())
                if self._metrics is not None:
                    tg.create_task(self._metrics.serve())
                self._front.restore()  # a router in front of a pipeline: its kept plan
                specs = await self.roster.reconcile()
                self.events.append("daemon.started", "daemon",
                                   f"mlxceld {__version__} started (pid {os.getpid()})",
                                   pid=os.getpid())
                log.info("mlxceld %s ready: node %s, control socket %s, %d worker(s)",
                         __version__, self.node.node_id, self.roster.config.socket, len(specs))
                if len(self.keys.keyring):
                    tg.create_task(self.speed.measure())  # for inventory: a thread, bounded
                    await self.member.start(tg)
                    await self._router_node_linked()
                self._notify.ready(status_line(self.status()))
                tg.create_task(self._notify.run(lambda: status_line(self.status())))
                if self.roster.config.dry_run:
                    code = await self._shutdown(dry_run=await self._dry_run())
                else:
                    await self._serve_commands(tg)  # until told to stop
                    code = await self._shutdown()
        finally:  # the shutdown's last step; also where start-up or a task failed
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            self._release()
        log.info("mlxceld stopped")
        return code

    def _finds_replicas(self) -> bool:
        """A router node with no --replicas (nor prefill and decode pools): its router
        is told discovery's candidates (``replica_peers.py``)."""
        serve = self.roster.config.serve
        return discovers(serve.node_role, serve.replicas,
                         pools=bool(serve.prefill_peers and serve.decode_peers),
                         front=serve.pipeline_coordinator is not None)

    async def _router_node_linked(self) -> None:
        """A router (or decode) node's router waits for the agent listener (its address is
        the identity it dials replicas and asks agents with: ``roster``): it starts now."""
        if self.roster.config.serve.node_role in (ROUTER_ROLE, *HANDOFF_SIDES):
            await self.roster.reconcile()

    async def _serve_commands(self, tg: asyncio.TaskGroup) -> None:
        while True:
            command = await self._commands.get()
            if command == "reload" or isinstance(command, asyncio.Future):
                self._notify.reloading()
                await self._reload("SIGHUP" if command == "reload" else "mlxctl reload",
                                   None if isinstance(command, str) else command)
                self._notify.ready(status_line(self.status()))
                continue
            if command == "agent":
                tg.create_task(self.speed.measure())
                await self.member.start(tg)
                await self._router_node_linked()
                continue
            return  # "stop"

    async def _shutdown(self, dry_run: int | None = None) -> int:
        """The shutdown order (see the module docstring); ``dry_run`` is a dry run's exit
        code: nothing to drain. ``_release`` follows once every task has ended."""
        code = 0 if dry_run is None else dry_run
        self.tensor.close()  # first: rank 0 forms no group again as its router stops
        if dry_run is None:
            # Admit no more work; a second SIGTERM/SIGINT forces.
            self._stopping = True
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._force)
            self.events.append("daemon.stopping", "daemon", "mlxceld is shutting down")
            # Every worker by its own stop timeout, then SIGKILL; all of them by the backstop.
            workers = len(self.supervisor.names())
            log.info("shutting down: stopping %d worker(s)", workers)
            deadline_s = self.supervisor.longest_stop_timeout() + SHUTDOWN_SLACK_S
            self._notify.stopping(deadline_s, workers)
            try:
                async with asyncio.timeout(deadline_s):
                    await self.supervisor.stop_all()
            except TimeoutError:
                log.warning("workers still running after %.0f s: SIGKILL to every worker group",
                            deadline_s)
                self.supervisor.kill_all()
                self.events.append("daemon.forced_stop", "daemon", "forced stop at the deadline")
                code = 1
            else:
                self.events.append("daemon.stopped", "daemon", "mlxceld stopped cleanly")
        # The services: the cluster's, the control API, the supervisor's tasks, the notifier.
        await self.member.aclose()
        self._stage.close()
        self._keeper.close()
        self._draining.service.close()
        self._replica_peers.close()
        self._front.close()
        if self._standby is not None:
            self._standby.close()
        self._server.request_shutdown()
        if self._metrics is not None:
            self._metrics.close()
        self.supervisor.close()
        self._notify.close()
        return code

    def _force(self) -> None:
        """A second SIGTERM/SIGINT while shutting down: kill every worker group, exit now."""
        log.warning("second signal: forcing shutdown, SIGKILL to every worker group")
        self.supervisor.kill_all()
        self._release()
        os._exit(1)

    async def _reload(self, trigger: str, answer: asyncio.Future[Reloaded] | None) -> None:
        """SIGHUP or `mlxctl reload` (``answer``: told what changed, or the error): bind the
        control socket again if its file is gone, re-read the config file and the API key
        file (a new key goes to the router live, and /metrics asks it at once) and reopen
        log files; never restart workers."""
        await self._keeper.restore(trigger)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.close()  # reopened on the next record
        try:
            new = serving_config(load_config(self._flags), self._flags)
            self.serving.check_reload(new.serve)  # --tp-size over what it would serve
            self.member.check_reload(new)  # ... or over a pipeline it coordinates
            api_key = read_api_key(new.serve.api_key_file) if new.serve.api_key_file else None
        except ConfigError as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            self.events.append("daemon.reload_failed", "daemon", f"reload failed: {exc}",
                               trigger=trigger)
            if answer is not None and not answer.done():
                answer.set_exception(exc)
            return
        changes = [*config_changes(self.roster.config, new),
                   *api_key_change(self.roster.api_key, api_key)]
        later = [c["key"] for c in changes if c["key"] in AT_NEXT_START]
        for key in later:
            log.warning("reload: %s changed; it takes effect at the next start", key)
        logging.getLogger().setLevel(new.log_level.upper())
        self.roster.config, self.roster.api_key = new, api_key  # the router, /metrics: at once
        self.roster.serve = self.serving.effective(new.serve)
        self.events.append("daemon.reloaded", "daemon", "configuration reloaded: "
                           + (", ".join(c["key"] for c in changes) or "nothing changed"),
                           trigger=trigger)
        log.info("configuration reloaded (%s): %s", trigger,
                 ", ".join(c["key"] for c in changes) or "nothing changed")
        await self.roster.reconcile()
        if answer is not None and not answer.done():
            answer.set_result(Reloaded(str(new.config_file) if new.config_file else None,
                                       list(changes), later))

    def _socket_event(self, kind: str, message: str, trigger: str) -> None:
        self.events.append(f"daemon.socket_{kind}", "daemon", message, trigger=trigger)

    def _release(self) -> None:
        """The shutdown's last step: remove the socket, close the database, release the lock."""
        remove_socket_file(self.roster.config.socket)
        with contextlib.suppress(Exception):
            self._sock.close()
        with contextlib.suppress(Exception):
            self._db.close()
        self._lock.release()


async def serve(config: Config, flags: Overrides, terminal: Terminal) -> int:
    return await Daemon(config, flags, terminal).run()
