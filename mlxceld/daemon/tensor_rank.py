"""A rank host (``--node-role tensor_parallel_rank``): rank >= 1 of a tensor-parallel group
whose rank 0 is another host's daemon (``--tp-peers``, ``daemon/tensor_peers.py``).

It runs no router. Rank 0's daemon asks its agent (MXCL channel 3, the cluster secret
authenticates both ends; ``wire/tensor_messages.py``):

- ``tensor_reserve`` (model identity, rank, size): refused (``error``) unless this daemon
  is a rank host serving a model of that identity; else it keeps a TCP port free for
  its ring endpoint on the IP the question reached it at (the interface rank 0 dialed:
  never a wildcard) and answers ``tensor_reserved`` with that ``host:port`` and what this
  host says of its RDMA (``engine/transport.py``, probed once in a child process), for
  rank 0's choice of transport. The port is kept for the daemon's life, so a group formed
  again meets at the same address.
- ``tensor_join`` (model identity, rank, the ring's ``host:port`` per rank, max batch):
  the same checks, and its own entry must be the one it reserved; then the worker
  ``tp-<rank>`` (``workers/tensor_rank.py``) starts with those options (one that runs is
  stopped first, within its stop timeout: rank 0 starts a new ring each time it asks),
  and it answers ``tensor_joined``. A join that names ``layers`` (and ``node_id``) is a
  pipeline stage's group (rank 0 a stage host's ``stage`` worker, ``daemon/stage_peers.py``):
  the worker is ``stage-tp-<rank>`` (``workers/stage_tensor.py``) over those layers; asked
  again with the same options while it is not stopped or failed it is kept (its stage
  restarted in the same ring, and so did it, under its own supervisor).
  The worker joins the ring within the ring's deadline
  (``engine/ring.py``, 60 s) or exits.

A ``--pp-peer`` stage host offered a pushed 2D mesh's rank past 0
(``cluster/assignment/stagehost.py``: ``assign``) answers the same questions while that
assignment stands, for that stage alone: a join must name its layers, its stage's node
id, its rank and its group's size; without one (or another's) it refuses, as any daemon
that is no rank host does.

The ring itself is unauthenticated: it binds only that IP, only while the worker runs.
``mlxctl status`` shows the rank (``tensor`` in the daemon's status).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from mlxceld.cluster.assignment.stagehost import RankAssignment
from mlxceld.config.daemon import Config
from mlxceld.discovery.inventory import AGENT_CHANNEL, model_entry, ring_ports
from mlxceld.engine.transport import HostReport, probe_in_child, report_json
from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService
from mlxceld.roles.options import StageTensorOptions, TensorOptions
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import JSON, TENSOR_RANK_ROLE, WorkerState
from mlxceld.wire import Envelope, encode_envelope
from mlxceld.wire.address import format_address
from mlxceld.wire.messages import Error, MessageError
from mlxceld.wire.tensor_messages import TensorJoin, TensorJoined, TensorReserve, TensorReserved

log = logging.getLogger(__name__)

REPORT_S: Final = 5.0  # the most the first tensor_reserved waits for this host's probe


class RankSlot(Protocol):
    """The roster's part: the rank this host runs, and the reconcile."""

    tensor_rank: TensorOptions | StageTensorOptions | None

    async def reconcile(self) -> list[WorkerSpec]: ...


def rank_worker(options: TensorOptions | StageTensorOptions) -> str:
    """The worker of a rank host's rank: ``tp-<rank>`` of a whole model's group,
    ``stage-tp-<rank>`` of a pipeline stage's."""
    return (f"stage-tp-{options.rank}" if isinstance(options, StageTensorOptions)
            else f"tp-{options.rank}")


class JoinRefused(Exception):
    """A question this rank host answers with ``error`` (the reason)."""


class RankHost:
    """The answers to rank 0's daemon, and this host's rank as status shows it."""

    def __init__(self, slot: RankSlot, supervisor: Supervisor,
                 config: Callable[[], Config]) -> None:
        self._slot = slot
        self._supervisor = supervisor
        self._config = config
        self._rings: dict[str, str] = {}  # our IP -> the host:port kept on it
        self._asked_by: str | None = None  # rank 0's agent identity, last heard
        self._joined_at: float | None = None
        self._probe: asyncio.Task[HostReport] | None = None  # this host's RDMA, once
        self._assigned: RankAssignment | None = None  # a pushed mesh's rank here

    def assign(self, rank: RankAssignment | None) -> None:
        """A pushed 2D mesh's rank past 0 on this ``--pp-peer`` host, or none (module
        docstring); the worker of one that ended is stopped by its stage host."""
        self._assigned = rank
        if rank is None:
            self._slot.tensor_rank = None

    def _role(self) -> bool:
        """Whether this daemon answers as a rank host now."""
        return (self._config().serve.node_role == TENSOR_RANK_ROLE
                or self._assigned is not None)

    def register(self, agent: AgentService) -> None:
        agent.add_handler(AGENT_CHANNEL, TensorReserve.T, self._on_reserve)
        agent.add_handler(AGENT_CHANNEL, TensorJoin.T, self._on_join)

    async def _report(self) -> dict[str, Any] | None:
        """This host's RDMA report for rank 0's transport choice (``engine/transport.py``):
        probed once, in a child process; None when it is not ready within ``REPORT_S``
        (rank 0 then counts this host as without RDMA: the ring)."""
        if self._probe is None:
            self._probe = asyncio.create_task(asyncio.to_thread(probe_in_child, "this host"))
        try:
            return report_json(await asyncio.wait_for(asyncio.shield(self._probe), REPORT_S))
        except TimeoutError:
            return None

    def describe(self) -> JSON | None:
        """``tensor`` in the daemon's status: this host's rank, its ring and rank 0."""
        if not self._role():
            return None
        o = self._slot.tensor_rank
        if o is None:
            return {"role": TENSOR_RANK_ROLE, "rank": None, "size": None, "ring": None,
                    "rank0": None, "asked_by": None, "joined_at": None, "state": "waiting"}
        got = self._supervisor.state(rank_worker(o))
        stage = ({"layers": list(o.layers), "node_id": o.node_id}
                 if isinstance(o, StageTensorOptions) else None)
        return {"role": TENSOR_RANK_ROLE, "rank": o.rank, "size": len(o.tp_hosts),
                "worker": rank_worker(o), "stage": stage,
                "ring": o.tp_hosts[o.rank], "rank0": o.tp_hosts[0], "asked_by": self._asked_by,
                "joined_at": self._joined_at, "state": str(got[0]) if got else "stopped"}

    async def _on_reserve(self, stream: MxclStream, message: Envelope) -> None:
        try:
            asked = TensorReserve.from_wire(message.header)
            await self._check(asked.model, stream)
            answer: Any = TensorReserved(self._ring(stream), await self._report())
        except (MessageError, JoinRefused) as exc:
            answer = Error(str(exc.reason if isinstance(exc, MessageError) else exc))
        await stream.send(encode_envelope(answer.to_wire()))

    async def _on_join(self, stream: MxclStream, message: Envelope) -> None:
        try:
            asked = TensorJoin.from_wire(message.header)
            await self._check(asked.model, stream)
            self._check_assigned(asked)
            mine = self._ring(stream)
            if asked.hosts[asked.rank] != mine:
                raise JoinRefused(f"rank {asked.rank}'s ring address is {asked.hosts[asked.rank]}"
                              f", and this host keeps {mine} for it: ask tensor_reserve first")
            await self._start(asked, stream)
            answer: Any = TensorJoined(asked.rank)
        except (MessageError, JoinRefused) as exc:
            answer = Error(str(exc.reason if isinstance(exc, MessageError) else exc))
        await stream.send(encode_envelope(answer.to_wire()))

    async def _check(self, model: str, stream: MxclStream) -> None:
        serve = self._config().serve
        if not self._role():
            raise JoinRefused(f"this daemon's node role is {serve.node_role}, not "
                          f"{TENSOR_RANK_ROLE}: start it with --node-role {TENSOR_RANK_ROLE}"
                          + (" (or push it a 2D mesh's rank)" if self._config().pp_peer
                             else ""))
        entry = await asyncio.to_thread(model_entry, serve.model)
        if entry is None or entry["identity"] is None:
            raise JoinRefused(f"this rank host cannot read its model {serve.model!r}: "
                          f"{(entry or {}).get('error')}")
        if entry["identity"] != model:
            raise JoinRefused(f"this rank host serves another model ({serve.model!r}, identity "
                          f"{entry['identity'][:12]}..., rank 0's is {model[:12]}...): give "
                          "both the same --model")

    def _check_assigned(self, asked: TensorJoin) -> None:
        """A join of a pushed mesh's rank: the stage, rank and size it was offered."""
        a = self._assigned
        if a is None or self._config().serve.node_role == TENSOR_RANK_ROLE:
            return
        said = (asked.node_id, asked.layers, asked.rank, len(asked.hosts))
        if said != (a.node_id, a.layers, a.rank, a.size):
            raise JoinRefused(f"this host is rank {a.rank} of {a.size} of stage {a.node_id!r} "
                              f"(layers {list(a.layers)}) in the plan it was pushed; the join "
                              f"asks rank {asked.rank} of {len(asked.hosts)} of "
                              f"{asked.node_id!r} (layers {asked.layers})")

    def _ring(self, stream: MxclStream) -> str:
        """The ``host:port`` kept for the ring on the IP ``stream`` reached us at."""
        host = stream.local_host
        if host is None:
            raise JoinRefused("this rank host cannot tell which address rank 0 reached it at")
        if host not in self._rings:
            ports = ring_ports(host, 1)
            if not ports:
                raise JoinRefused(f"this rank host has no free TCP port on {host} for the ring")
            self._rings[host] = format_address(host, ports[0])
        return self._rings[host]

    async def _start(self, asked: TensorJoin, stream: MxclStream) -> None:
        serve = self._config().serve
        assert serve.model is not None  # config/tensor.py: a rank host names its model
        options: TensorOptions | StageTensorOptions
        if asked.layers is not None:
            assert asked.node_id is not None  # from_wire: said together
            options = StageTensorOptions(model=serve.model, layers=asked.layers,
                                         node_id=asked.node_id, rank=asked.rank,
                                         tp_hosts=asked.hosts)
        else:
            options = TensorOptions(model=serve.model, model_name=serve.served_name,
                                    rank=asked.rank, tp_hosts=asked.hosts,
                                    max_batch=asked.max_batch)
        name = rank_worker(options)
        got = self._supervisor.state(name)
        if (asked.layers is not None and options == self._slot.tensor_rank and got is not None
                and got[0] not in (WorkerState.FAILED, WorkerState.EXITED)):
            # A stage's group asked again in the same ring (its stage restarted): this
            # rank, restarted by its own supervisor meanwhile, meets it there; a restart
            # here would break the ring the stage is joining.
            log.info("tensor rank %d of %d: %s kept (%s), ring %s", asked.rank,
                     len(asked.hosts), name, got[0], ",".join(asked.hosts))
            return
        for old in {name, *((rank_worker(self._slot.tensor_rank),)
                            if self._slot.tensor_rank is not None else ())}:
            if self._supervisor.state(old) is not None:
                # A new ring: the old worker is gone before the answer (one still in the
                # old ring's join could otherwise meet rank 0's new one), then a new starts.
                await self._supervisor.remove(old)
        self._slot.tensor_rank = options
        await self._slot.reconcile()
        self._asked_by = stream.peer_identity
        self._joined_at = time.time()
        log.info("tensor rank %d of %d: %s starts, ring %s (asked by %s)", asked.rank,
                 len(asked.hosts), name, ",".join(asked.hosts), stream.peer_identity)
