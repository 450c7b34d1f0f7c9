"""Rank 0 of a tensor-parallel group across hosts (``--tp-size N --tp-peers A1,...``).

The router worker is rank 0; ranks 1 .. N-1 run on the hosts whose agents ``tp_peers``
names, in rank order, each a daemon started with ``--node-role tensor_parallel_rank``
(``daemon/tensor_rank.py``). ``TensorPeers`` forms the group and keeps it:

- forming: each rank host is asked (MXCL channel 3, ``wire/tensor_messages.py``, as this
  daemon's agent: the cluster secret on both ends) to keep a ring port
  (``tensor_reserve``: the model's identity checked there; it answers the ``host:port``
  it binds, on the IP we reached it at), then to join (``tensor_join``: its rank, the
  whole ring, the router's max batch): its daemon starts its ``tp-<rank>`` worker. Rank
  0's own ring endpoint is this daemon's agent IP (the IP that routes to the first rank
  host when the agent listens on a wildcard) and a port kept free for it. Once every
  rank host answered, the roster runs the router over that ring (``Roster.tensor_ring``)
  and the ranks meet in it (``engine/ring.py``: within 60 s, else each exits). A rank
  host that does not answer (down, another model, another role) is asked again after
  1, 2, 4, then every ``MAX_RETRY_S`` (8) s; each answer within ``CONNECT_S`` +
  ``ANSWER_S`` (5 + 60 s: the rank host may stop its old worker first).
- kept: every ``WATCH_S`` (1 s) the router's state is read, and every ``CHECK_S`` (2 s)
  each rank host's agent is asked ``serving`` (``discovery/serving.py``: at most 10 s).
  A rank host that does not answer as a rank host, or the router leaving RUNNING (its
  engine's watchdog ends it when a rank's op link closes or its steps stall:
  ``engine/tensor.py``; requests in flight then get a 503 naming the rank and host),
  or a new router process (the supervisor restarted it, maybe between two looks: it
  waits in the old ring, which its other ranks left; the rank hosts are asked first, so
  that one gone is named as the cause) ends the group: the router is stopped (one that
  does not run within ``GROUP_STOP_S``: waiting in mlx's ring join it takes no SIGTERM,
  and would hold the requests it took until the ring's 60 s ran out), and the group is
  formed again as above. A rank host whose daemon restarted reserves another ring port:
  the ring formed then is said to have moved (``tensor.ring_moved``).

While the group is not formed, and until its router runs (the router binds the port
beside it and loads meanwhile), the OpenAI port answers 503 naming the rank, its host and
why (``daemon/tensor_standin.py``), ``GET /ready`` included: no client is refused.
``mlxctl status`` shows the group (``tensor``: each rank's host, ring address and state,
and the transport chosen at formation over every host's RDMA report,
``engine/transport.py``: the ring here, named why).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from mlxceld.cluster.clusterfile.placement import STAGE_WORKER
from mlxceld.config.serve import ROUTER
from mlxceld.daemon.roster import Roster, stage_group
from mlxceld.daemon.stage_peers import StagePeers
from mlxceld.daemon.tensor_rank import RankHost
from mlxceld.daemon.tensor_standin import StandIn
from mlxceld.discovery.inventory import AGENT_CHANNEL, model_entry, ring_ports
from mlxceld.discovery.serving import ServingNotFound, ask_serving
from mlxceld.engine.transport import (
    HostReport,
    TransportChoice,
    choose_transport,
    probe_in_child,
    report_from_json,
)
from mlxceld.net.agent import AgentService, ask
from mlxceld.net.errors import AskFailed
from mlxceld.state.events import EventLog
from mlxceld.supervisor.groups import GROUP_STOP_S
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import JSON, TENSOR_RANK_ROLE, WorkerState
from mlxceld.wire import MessageSpec, SecretStore
from mlxceld.wire.address import format_address, parse_address
from mlxceld.wire.messages import Message
from mlxceld.wire.tensor_messages import TensorJoin, TensorJoined, TensorReserve, TensorReserved

log = logging.getLogger(__name__)

WATCH_S: Final = 1.0
STARTED_POLL_S: Final = 0.05  # how often a starting router's state is read
ROUTER_START_S: Final = 1800.0  # the most the stand-in waits for it (a large model's load)
UNSEEN_S: Final = 5.0  # a router the supervisor does not know after this: none was started
CHECK_S: Final = 2.0
MAX_RETRY_S: Final = 8.0
CONNECT_S: Final = 5.0
# The rank host reads its model's identity, and stops a worker it ran (its stop timeout).
ANSWER_S: Final = 60.0
# Told the ring once its ports are reserved, before the joins start the ranks.
BeforeJoin = Callable[[tuple[str, ...]], Awaitable[None]]
_SPECS: Final = {TensorReserved.T: MessageSpec(), TensorJoined.T: MessageSpec()}


@dataclass
class RankState:
    """A rank host as status shows it."""

    rank: int
    agent: str
    state: str = "waiting"  # waiting | joined | lost
    ring: str | None = None
    error: str | None = None
    since: float = 0.0
    report: HostReport | None = None  # its RDMA, as its tensor_reserved said


class TensorPeers:
    def __init__(self, roster: Roster, supervisor: Supervisor, keyring: SecretStore,
                 events: EventLog, origin: Callable[[], str | None]) -> None:
        self._roster = roster
        self._supervisor = supervisor
        self._keyring = keyring
        self._events = events
        self._origin = origin
        # --tp-peers, or a 2D mesh's stage placed by its cluster TOML (stage_group)
        peers = roster.serve.tp_peers or stage_group(roster.placement, roster.serve)[1]
        self.ranks = [RankState(r, a) for r, a in enumerate(peers, start=1)]
        self.formed = False
        self._ring0: str | None = None  # our ring endpoint, kept
        self._why = "the tensor-parallel group is forming"
        self._probe: asyncio.Task[HostReport] | None = None  # this host's RDMA, once
        self.transport: TransportChoice | None = None  # chosen at the last formation
        self._standin: StandIn | None = None  # the OpenAI port's while the group is down
        self.stage: tuple[tuple[int, int], str] | None = None  # a stage's group: formed for
        self._last: tuple[str, ...] | None = None  # the router's group: the last ring formed
        self._pid: int | None = None  # the router process that group runs

    def describe(self) -> JSON | None:
        """``tensor`` in the daemon's status: the group, each rank's host and state."""
        if not self.ranks:
            return None
        stage = self._roster.stage_across()  # a pipeline stage's group (stage_peers.py)
        got = self._supervisor.state(STAGE_WORKER if stage else ROUTER)
        zero = {"rank": 0, "agent": self._origin(), "ring": self._ring0, "error": None,
                "worker": STAGE_WORKER if stage else ROUTER,
                "state": str(got[0]) if got else "stopped"}
        return {"role": "rank0", "size": len(self.ranks) + 1,
                "stage": {"layers": list(self.stage[0]), "node_id": self.stage[1]}
                if stage and self.stage else None,
                # the daemon answers the OpenAI port (503) beside or instead of the router
                "standin": bool(self._standin and self._standin.listening),
                "transport": {"backend": self.transport.backend,
                              "reason": self.transport.reason} if self.transport else None,
                "state": "formed" if self.formed else "down", "why": None if self.formed
                else self._why, "ranks": [zero] + [
                    {"rank": r.rank, "agent": r.agent, "ring": r.ring, "state": r.state,
                     "error": r.error, "since": r.since} for r in self.ranks]}

    async def run(self) -> None:
        if not self.ranks or self._roster.stage_across():  # a stage's: daemon/stage_peers.py
            return
        serve = self._roster.serve
        standin = self._standin = StandIn(serve.host, serve.port, lambda: self._why)
        attempt = 0
        try:
            while True:
                if not self.formed:
                    await standin.open()
                    ring = await self._form(before_join=self._moved)
                    if ring is None:
                        if self._origin() is None:  # the agent listener is not up yet
                            await asyncio.sleep(WATCH_S)
                            continue
                        await asyncio.sleep(min(MAX_RETRY_S, 2.0 ** attempt))
                        attempt += 1
                        continue
                    self._why = ("the tensor-parallel group formed; its router is starting "
                                 "(loading its share of the model)")
                    self._roster.tensor_ring, self.formed, attempt = ring, True, 0
                    self._last, self._pid = ring, None
                    await self._roster.reconcile()
                    self._events.append("tensor.formed", "tensor", "tensor-parallel group of "
                                        f"{len(ring)} ranks formed: ring {','.join(ring)}")
                    await self._router_started()
                    self._pid = self._router_pid()
                    await standin.close()  # the router holds the port (SO_REUSEPORT) now
                else:
                    self._why = await self._watch()
                    log.warning("tensor group: %s", self._why)
                    self._events.append("tensor.lost", "tensor", self._why)
                    self._roster.tensor_ring, self.formed = None, False
                    await standin.open()  # beside a router still stopping: no refusal
                    await self._stop_router()
                    await self._roster.reconcile()
        finally:
            await standin.close()

    # -- forming ---------------------------------------------------------------------------

    async def _form(self, stage: tuple[tuple[int, int], str] | None = None,
                    before_join: BeforeJoin | None = None) -> tuple[str, ...] | None:
        """Every rank host reserved and joined: the ring; None when one was not (its
        state says why, and ``_why``). ``stage``: the layers and node id of the pipeline
        stage whose group this is (``daemon/stage_peers.py``); ``before_join``: awaited
        with the ring once every port is reserved, before any rank host is asked to join
        (and so starts its rank)."""
        origin = self._origin()
        placed = self._roster.placement  # a stage placed by a cluster TOML: its model
        model_dir = self._roster.serve.model or (str(placed.model) if placed else None)
        entry = await asyncio.to_thread(model_entry, model_dir)
        if origin is None or entry is None or entry["identity"] is None:
            self._why = ("the tensor-parallel group is forming: "
                         + ("the agent listener is not up yet" if origin is None
                            else f"this host cannot read its model: {(entry or {}).get('error')}"))
            return None
        model, size = entry["identity"], len(self.ranks) + 1
        rings: list[str] = []
        for r in self.ranks:
            got = await self._ask(r, origin, TensorReserve(model, r.rank, size))
            if got is None:
                return None
            reserved = TensorReserved.from_wire(got)
            r.ring, r.report = reserved.ring, self._report_of(r, reserved.host)
            rings.append(r.ring)
        ring0 = await asyncio.to_thread(self._own_ring, origin)
        if ring0 is None:
            return None
        ring = (ring0, *rings)
        self.transport = await self._choose(parse_address(ring0).host)
        if before_join is not None:
            await before_join(ring)
        batch = self._roster.serve.max_batch
        for r in self.ranks:
            join = TensorJoin(model, r.rank, ring, batch, *(stage or (None, None)))
            if await self._ask(r, origin, join) is None:
                return None
            r.state, r.error, r.since = "joined", None, time.time()
        return ring

    def use_peers(self, peers: tuple[str, ...]) -> None:
        """The rank hosts of the group to form: a pushed 2D mesh's stage names its own
        (``Placement.tp_peers``), which may differ from those at the daemon's start."""
        if tuple(r.agent for r in self.ranks) != peers:
            self.ranks = [RankState(r, a) for r, a in enumerate(peers, start=1)]

    async def form_stage(self, layers: tuple[int, int], node_id: str,
                         before_join: BeforeJoin | None = None) -> tuple[str, ...] | None:
        """A pipeline stage's group over the rank hosts (``daemon/stage_peers.py``): the
        ring, or None (``why`` says why); ``before_join`` as ``_form``'s."""
        ring = await self._form((layers, node_id), before_join)
        self.formed = ring is not None
        self.stage = (layers, node_id) if ring is not None else None
        return ring

    @property
    def why(self) -> str:
        return self._why

    def _report_of(self, r: RankState, said: dict[str, Any] | None) -> HostReport:
        """Rank ``r``'s host report, named by its agent's host; one it did not send (or
        sent malformed, logged) counts as a host without RDMA."""
        host = parse_address(r.agent).host
        if said is not None:
            try:
                return report_from_json(host, said)
            except ValueError as exc:
                log.warning("tensor rank %d on %s: its host report is refused: %s", r.rank,
                            r.agent, exc)
        return HostReport(host, "unreported", None, False, ())

    async def _choose(self, here_host: str) -> TransportChoice:
        """The group's backend over every rank's host report (``engine/transport.py``);
        this host is probed once, in a child process. The ring is what forms whatever the
        choice says: no Thunderbolt link between hosts is read yet, so it says the ring."""
        if self._probe is None:
            self._probe = asyncio.create_task(asyncio.to_thread(probe_in_child, here_host))
        here = await asyncio.shield(self._probe)
        choice = choose_transport([here, *(r.report for r in self.ranks if r.report)])
        if choice != self.transport:
            log.info("tensor group transport: %s", choice.line())
        return choice

    async def _ask(self, r: RankState, origin: str, question: Message) -> dict[str, object] | None:
        try:
            answer = await ask(origin, r.agent, question, keyring=self._keyring,
                               channel=AGENT_CHANNEL, answers=_SPECS, connect_s=CONNECT_S,
                               answer_s=ANSWER_S)
        except AskFailed as exc:
            self._lost(r, f"its agent did not take '{question.to_wire()['t']}' ({exc.kind}): "
                       f"{exc.message}")
            return None
        return answer.header

    def _own_ring(self, origin: str) -> str | None:
        """Our ring endpoint: the agent's IP (or the one routing to the first rank host),
        a port free on it, kept while it stays free."""
        host = parse_address(origin).host
        if parse_address(origin).is_wildcard:
            peer = parse_address(self.ranks[0].agent)
            try:
                with socket.socket(socket.AF_INET6 if ":" in peer.host else socket.AF_INET,
                                   socket.SOCK_DGRAM) as s:
                    s.connect((peer.host, peer.port))
                    host = s.getsockname()[0]
            except OSError as exc:
                self._why = f"no route to rank 1's host {peer.host}: {exc.strerror}"
                return None
        if self._ring0 is not None and parse_address(self._ring0).host == host:
            return self._ring0
        ports = ring_ports(host, 1)
        if not ports:
            self._why = f"no free TCP port on {host} for rank 0's ring endpoint"
            return None
        self._ring0 = format_address(host, ports[0])
        return self._ring0

    def _lost(self, r: RankState, error: str) -> None:
        if r.state != "lost" or r.error != error:
            log.warning("tensor rank %d on %s: %s", r.rank, r.agent, error)
        r.state, r.error, r.since = "lost", error, time.time()
        self._why = (f"tensor-parallel rank {r.rank} on host {r.agent} is lost: {error}; "
                     "the group forms again when that host is back")

    # -- kept ------------------------------------------------------------------------------

    async def _router_started(self) -> None:
        """Until the router runs (it binds the OpenAI port beside the stand-in, then
        loads), or fails to start (the watch then finds the group broken), or
        ``ROUTER_START_S`` passed. The reconcile's start is taken by the supervisor a
        moment later: a router still unknown or exited after ``UNSEEN_S`` was not
        started."""
        start = time.monotonic()
        while time.monotonic() - start < ROUTER_START_S:
            got = self._supervisor.state(ROUTER)
            state = got[0] if got is not None else None
            if state in (WorkerState.RUNNING, WorkerState.BACKOFF, WorkerState.FAILED):
                return
            if state in (None, WorkerState.EXITED) and time.monotonic() - start > UNSEEN_S:
                return
            await asyncio.sleep(STARTED_POLL_S)

    async def _moved(self, ring: tuple[str, ...]) -> None:
        """``_form``'s ``before_join``: a ring that moved from the last one formed (a rank
        host's daemon restarted, and reserved another port) is said, before its ranks
        join. No router runs over the old ring by then: the group's end stopped it
        (``_stop_router``), and none is drawn until the new ring is set."""
        was = self._last
        if was is None or ring == was:
            return
        moved = ", ".join(f"rank {r} {a} -> {b}"
                          for r, (a, b) in enumerate(zip(was, ring, strict=False)) if a != b)
        why = (f"the tensor-parallel ring moved ({moved}): the router starts over the new "
               "one")
        log.info("%s", why)
        self._events.append("tensor.ring_moved", "tensor", why, was=list(was),
                            now=list(ring))

    async def _stop_router(self) -> None:
        """The group ended: a router that is not running (restarted by the supervisor
        over the ring being left, maybe waiting in mlx's join, which takes no SIGTERM, and
        holding the requests it took) is removed within ``GROUP_STOP_S``; a running one
        is stopped by the reconcile, as any worker (within its stop timeout)."""
        got = self._supervisor.state(ROUTER)
        if got is not None and got[0] is not WorkerState.RUNNING:
            await self._supervisor.remove(ROUTER, "its tensor-parallel group ended",
                                          within_s=GROUP_STOP_S)

    def _router_pid(self) -> int | None:
        view = next((v for v in self._supervisor.snapshot() if v.name == ROUTER), None)
        return view.pid if view is not None else None

    async def _watch(self) -> str:
        """Wait until the group breaks; why."""
        checked = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_S)
            pid = self._router_pid()
            if self._pid is None:
                self._pid = pid  # the router the group started (once it has a process)
            elif pid is not None and pid != self._pid:  # restarted between two looks
                return await self._restarted(pid)
            got = self._supervisor.state(ROUTER)
            down = got is None or got[0] in (WorkerState.BACKOFF, WorkerState.EXITED,
                                             WorkerState.FAILED)
            if down or time.monotonic() - checked >= CHECK_S:
                checked = time.monotonic()
                if await self._check() is not None:
                    return self._why
                if down:
                    return (f"rank 0 (the router) stopped ({got[1] if got else 'gone'}); the "
                            "group forms again")

    async def _restarted(self, pid: int) -> str:
        """Why the group ended when its router was restarted between two looks: a rank
        host that does not answer caused it, and is named (``_check``: at most 10 s a
        rank host); else the restart itself."""
        if await self._check() is not None:
            return self._why
        return (f"rank 0 (the router) was restarted (pid {pid}) in a ring its other ranks "
                "left with the old one; the group forms again")

    async def _check(self) -> RankState | None:
        """The first rank host that does not answer as a rank host, if any."""
        origin = self._origin()
        if origin is None:
            return None
        for r in self.ranks:
            try:
                serving = await ask_serving(origin, r.agent, keyring=self._keyring)
            except ServingNotFound as exc:
                self._lost(r, exc.message)
                return r
            if serving.role != TENSOR_RANK_ROLE:
                self._lost(r, f"it is now a {serving.role} node")
                return r
        return None


class TensorWindow:
    """This daemon's part in a tensor-parallel group across hosts, as the composition
    root holds it: rank 0's ``TensorPeers`` or a rank host's ``RankHost``, or neither."""

    def __init__(self, roster: Roster, supervisor: Supervisor, keyring: SecretStore,
                 events: EventLog, origin: Callable[[], str | None]) -> None:
        self.peers = TensorPeers(roster, supervisor, keyring, events, origin)
        self.rank = RankHost(roster, supervisor, lambda: roster.config)
        self.stage = StagePeers(roster, supervisor, events, self.peers, self.rank)
        self._closing = asyncio.Event()

    def register(self, agent: AgentService) -> None:
        """The rank host's answers on the agent (refusals on any other daemon)."""
        self.rank.register(agent)

    async def run(self) -> None:
        """Rank 0's group until ``close``: its formation, watch or backoff is cancelled
        then (the stand-in lets the port go on the way), so the daemon's stop does not
        wait for it."""
        work = asyncio.create_task(self._work())
        closing = asyncio.create_task(self._closing.wait())
        try:
            await asyncio.wait({work, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, closing):
                task.cancel()
            await asyncio.gather(work, closing, return_exceptions=True)
        if work.done() and not work.cancelled():
            work.result()  # what ended it on its own, raised as before

    async def _work(self) -> None:
        await asyncio.gather(self.peers.run(), self.stage.run())

    def close(self) -> None:
        """The shutdown's first step here: no group formed again once the router stops."""
        self._closing.set()

    def describe(self) -> JSON | None:
        return self.peers.describe() or self.rank.describe()
