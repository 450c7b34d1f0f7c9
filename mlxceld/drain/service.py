"""The daemon's side of a drain, in the spirit of ``nomad node drain``.

`mlxctl drain NODE` writes the node's row (``state/drains.py``: ``draining``, its
deadline, or the drain's start with ``--force``) before anything else, so that it
survives a restart of the daemon. Then, every ``PUSH_EVERY_S`` (and at once after a
change), the router worker is told every drain in force of the nodes its requests
need (its control channel's ``drain`` op; ``api/edge/draining.py`` says what it does
with them: 503 "draining" for new requests, the running ones finish, the deadline
ends the rest), and answers how many requests are still in flight. A draining node
whose router has none left is ``drained``; its row keeps the counts (finished,
ended at the deadline). On a node that serves routers too (a replica or hybrid node's
serving listener, a prefill or decode node: their worker's ``drain`` op drains that
listener as well), the count is its own clients' and the routers' sequences together,
and ``senders`` names who still sends work. A node no request of this daemon's router needs (a peer
outside the plan, a daemon that runs no router) is drained at once. `mlxctl
undrain NODE` deletes the row; the next push lets the router admit again.

The push is said again and again, so a router that restarts, or a daemon that
restarts while its router keeps running, converges within ``PUSH_EVERY_S``. A router
that does not answer (starting, stopped) leaves the state as it is.

On a coordinator, a drain of a node that holds a stage of the plan served is re-planned
around first (``cluster/healer.py``: ``started`` is called with the node and ``--force``
as its drain starts): while that re-plan runs (``held`` names the node), up to the
drain's deadline, the drain is not said to the router and the row stays ``draining``,
so requests go on being admitted on the old plan; once the new plan serves, the
router's requests no longer need the node and it is ``drained``; if the model does not
fit without it (``drain.no_fit``), the drain goes on as above.

A stage host's own daemon refuses to drain its node (``refuse_stage_host``:
``DrainRefused``, nothing recorded): its coordinator sends it the work, and only the
coordinator can re-plan around it (`mlxctl drain NODE` there).

Every change is an event: ``drain.started``, ``drain.changed`` (a new deadline),
``drain.drained``, ``drain.ended`` (undrained).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Final

from mlxceld.control.answers import DrainView, Undrained
from mlxceld.errors import DrainRefused, UnknownNode
from mlxceld.state import DrainRow, DrainsTable, EventLog
from mlxceld.types import JSON

log = logging.getLogger(__name__)

PUSH_EVERY_S: Final = 0.5  # how often the router is told the drains (and asked its count)

Needs = Callable[[], frozenset[str] | None]  # the nodes the router's requests need; None:
#                                             no router runs here
RouterCall = Callable[[JSON], Awaitable[JSON | None]]  # the drain op; None: no answer


class DrainService:
    def __init__(self, table: DrainsTable, events: EventLog, *, needs: Needs,
                 call_router: RouterCall,
                 started: Callable[[str, bool], None] | None = None,
                 held: Callable[[], frozenset[str]] = frozenset) -> None:
        self._table = table
        self._events = events
        self._needs = needs
        self._call = call_router
        self._started = started
        self._held = held  # draining nodes not to be said to the router yet (a re-plan)
        self._wake = asyncio.Event()
        self._pushed: list[JSON] | None = None  # what the router was told last (None: unknown)
        self._counts: JSON = {}  # the router's last answer: in_flight, finished, ended,
        #                          senders
        self._replanned: set[str] = set()  # draining nodes that were held for a re-plan
        self._closing = False

    # -- commands -------------------------------------------------------------------------

    def list(self) -> list[DrainView]:
        """Every drain's row, with ``replanning`` (its drain waits for a re-plan around the
        node) and, while it drains, the router's last counts: ``in_flight`` (None: not
        known, or not said to the router yet), ``finished`` and ``ended`` so far, and
        ``senders``: who still sends work (this node's OpenAI clients, each router with
        sequences on its serving listener, with their counts; None: not known)."""
        held = self._held()
        told = {d["node"] for d in self._pushed or []}
        out = []
        for r in self._table.all():
            in_flight: int | None = 0
            senders: list[JSON] | None = []
            if r.state == "draining":
                live = r.node_id in told and bool(self._counts)
                in_flight = self._counts.get("in_flight") if live else None
                senders = list(self._counts.get("senders") or []) if live else None
                if live:
                    r = replace(r, finished=int(self._counts.get("finished") or 0),
                                ended=int(self._counts.get("ended") or 0))
            out.append(DrainView(r, r.node_id in held, in_flight, senders))
        return out

    def drain(self, node: str, deadline_s: float | None, force: bool) -> DrainRow:
        """Start draining ``node`` (or change the deadline of its drain): ``deadline_s``
        from now (None: none), or now with ``force``."""
        now = time.time()
        deadline = now if force else None if deadline_s is None else now + deadline_s
        said = ("at once (--force)" if force else "no deadline" if deadline is None
                else f"deadline in {deadline_s:g} s")
        old = self._table.get(node)
        if old is None:
            row = DrainRow(node, "draining", now, deadline, force, now,
                           f"mlxctl drain: {said}")
            self._table.put(row)
            self._events.append("drain.started", node, f"node {node} is draining ({said})",
                                deadline=deadline, force=force)
            log.info("node %s is draining (%s)", node, said)
            if self._started is not None:
                self._started(node, force)
        else:
            row = replace(old, deadline=deadline, force=force, updated_at=now,
                          reason=f"mlxctl drain again: {said}")
            self._table.put(row)
            self._events.append("drain.changed", node, f"drain of node {node}: {said}",
                                deadline=deadline, force=force)
            log.info("drain of node %s changed: %s", node, said)
        self._wake.set()
        return row

    def undrain(self, node: str) -> Undrained:
        """End ``node``'s drain: requests that need it are admitted again."""
        old = self._table.get(node)
        if old is not None:
            self._table.delete(node)
            self._events.append("drain.ended", node, f"node {node} is undrained: requests "
                                "that need it are admitted again", was=old.state)
            log.info("node %s undrained (was %s)", node, old.state)
            self._wake.set()
        return Undrained(node, old)

    # -- the router -----------------------------------------------------------------------

    async def run(self) -> None:
        """Push every ``PUSH_EVERY_S`` and after each change, until ``close``."""
        while not self._closing:
            self._wake.clear()
            await self.push()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PUSH_EVERY_S):
                    await self._wake.wait()

    def close(self) -> None:
        self._closing = True
        self._wake.set()

    async def push(self) -> None:
        held, now = self._held(), time.time()
        rows = [r for r in self._table.all() if r.node_id not in held
                or (r.deadline is not None and r.deadline <= now)]  # held to its deadline
        needed = self._needs()
        mine = [r for r in rows if needed is not None and r.node_id in needed]
        self._replanned |= held
        for r in rows:
            if r.state == "draining" and r not in mine:
                why = ("no router runs on this node" if needed is None
                       else "re-planned around: the plan served no longer needs it"
                       if r.node_id in self._replanned
                       else "no request of this node's router needs it")
                self._drained(r, why, 0, 0)
        self._replanned &= {r.node_id for r in rows if r.state == "draining"} | held
        if needed is None:
            return
        drains: list[JSON] = [{"node": r.node_id, "deadline": r.deadline} for r in mine]
        if not drains and self._pushed == []:
            return  # nothing to say, and said already
        reply = await self._call({"drains": drains})
        if reply is None:
            self._pushed, self._counts = None, {}  # unknown: say it again next time
            return
        self._pushed = drains
        self._counts = {k: reply.get(k) for k in ("in_flight", "finished", "ended",
                                                  "senders")}
        if reply.get("in_flight") != 0:
            return
        finished, ended = int(reply.get("finished") or 0), int(reply.get("ended") or 0)
        for r in mine:
            if r.state == "draining":
                self._drained(r, "no request that needs it is running", finished, ended)

    def _drained(self, row: DrainRow, why: str, finished: int, ended: int) -> None:
        """Mark ``row``'s drain drained, unless an operator changed it since ``row`` was
        read (``push`` awaits the router in between): an undrain, or a drain started
        anew, is later and wins; a new deadline is kept."""
        current = self._table.get(row.node_id)
        if (current is None or current.state != "draining"
                or current.started_at != row.started_at):
            return
        row, now = current, time.time()
        self._table.put(replace(row, state="drained", updated_at=now, reason=why,
                                finished=finished, ended=ended))
        took = now - row.started_at
        self._events.append("drain.drained", row.node_id,
                            f"node {row.node_id} drained in {took:.1f} s: {why} ({finished} "
                            f"finished, {ended} ended at the deadline)",
                            finished=finished, ended=ended, took_s=round(took, 3))
        log.info("node %s drained in %.1f s: %s (%d finished, %d ended at the deadline)",
                 row.node_id, took, why, finished, ended)


def refuse_stage_host(target: str, own: set[str], stage: str | None,
                      coordinator: tuple[str, str] | None) -> None:
    """``DrainRefused`` when ``target`` is this node (one of ``own``) and it holds
    ``stage`` of a pipeline whose ``coordinator`` (its node id and address) sends it the
    work: only that daemon can re-plan around it, and this one would say "drained" while
    the work goes on coming. Nothing is recorded."""
    if stage is None or coordinator is None or target not in own:
        return
    node, address = coordinator
    raise DrainRefused(
        f"node {target} holds stage {stage} of the pipeline coordinated by node {node} "
        f"({address}): its work comes from that coordinator, and this daemon cannot move "
        "it elsewhere; nothing changed here",
        hint=f"drain it on the coordinator's host: `mlxctl drain {stage}` there re-plans "
        "the pipeline around this node")


def known_node(target: str, known: set[str]) -> str:
    """``target`` if it is one of the ``known`` nodes (this node, a node of its router's
    requests, a peer discovery knows); else ``UnknownNode`` naming them."""
    if target not in known:
        raise UnknownNode(f"no node {target!r} is known here; the nodes are "
                          f"{', '.join(sorted(known))}",
                          hint="see `mlxctl cluster nodes`; drain a pipeline's stage on "
                          "the coordinator, whose router sends it requests")
    return target
