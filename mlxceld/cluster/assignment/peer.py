"""A peer's side of the two-phase stage assignment: the asyncio shell around ``PeerRound``.

The coordinator's ``offer`` arrives on channel 2 (``push.py``); so do
``commit``, ``activate`` and ``abort``, on the same connection. A daemon that
is not a peer (no ``--pp-peer``) refuses every offer with code ``not_a_peer``
(not final: start it with ``--pp-peer`` and push again).

An offer from another coordinator while the lease of the one whose plan this host holds
runs (``cluster/lease.py``: ``leased``) is refused (code ``lease``) before any round.

The offer's listener port: the inventory proposes free ports afresh on every
answer and keeps no record of them, so a peer accepts any offered port that it
can bind on its agent host when the offer arrives (``stagehost.port_is_free``).

Each ``Record`` is written to the ``assignments`` table before the ``Reply``
after it goes out. An offer of another plan while a round is on is settled by
``PeerRound.on_other_offer`` (stale, busy, or a newer plan superseding an
undecided round). Preparing (loading the stage in standby) runs as a task and
sends ``preparing`` every ``HEARTBEAT_S`` until it ends; the daemon's
``AssignedStage`` bounds it by its progress (``stagehost.LOAD_STALL_S`` without a
byte read), and each heartbeat moves the round's own deadline
(``PREPARE_S`` past it: ``PeerRound.on_still_loading``). One timer task calls
``handle_timer`` at the round's deadline (``PHASE_S`` between phases: 60 s,
or ``MLXCELD_TEST_PEER_WAIT_S`` in tests, see ``mlxceld.failpoints``); a
``Query`` dials the coordinator (``CONNECT_S`` to connect, ``FRAME_S`` for the
answer), and a coordinator that cannot be asked ends the round (aborted).

``deactivate`` (`mlxctl cluster deactivate`, ``deactivation.py``) comes from
the coordinator that offered the plan, or from the one that offered a newer plan
taken here (a standby that took the plan over, ``daemon/standby.py``, retiring it:
it could replace the stage anyway), on a connection of its own: the stage stops,
the assignment is recorded deactivated, ``deactivated`` answers. A plan this peer
never ran, or one a newer plan superseded here, is only recorded
(its stage is not this plan's).

On start, the latest assignment is resumed as its record left it
(``PeerRound.resume``, whatever the record): ``preparing`` is recorded aborted
(no vote went out, so nothing was decided with it; the standby stage the daemon
left loading is stopped), ``accepted`` and ``committed`` load the stage back in
standby and wait again (``PHASE_S``, then ``query``), and an ended round answers
a commit or activate re-sent to it with ``aborted`` and its reason. An
assignment recorded active first asks its coordinator (``query``, at most
``CONNECT_S`` + ``FRAME_S``): when the plan was deactivated meanwhile, the stage
does not come back; on any other answer, or none (the coordinator may be
restarting too), it comes back active. A coordinator that re-dials a restarted
peer may send ``activate`` while its stage still loads: switching it on, and
answering ``active``, wait until it runs (while its load advances, as above).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from mlxceld import failpoints
from mlxceld.cluster.assignment.offers import Refusal, judge, offered_node
from mlxceld.cluster.assignment.peer_round import (
    HOLDS_A_STAGE,
    PEER_PHASE_S,
    PeerAction,
    PeerRound,
    PeerState,
    Query,
    Record,
    Reply,
    StageAction,
)
from mlxceld.cluster.assignment.push import ASSIGNMENT_CHANNEL, HEARTBEAT_S, epoch_of, sent
from mlxceld.cluster.assignment.query import ask_decision
from mlxceld.cluster.assignment.stagehost import AssignedStage
from mlxceld.errors import MlxceldError
from mlxceld.net import ConnectionClosed, MxclStream
from mlxceld.net.agent import AgentService
from mlxceld.net.resolve import Resolver
from mlxceld.state.events import EventLog
from mlxceld.state.plans import Assignments
from mlxceld.tasks import cancelling_group
from mlxceld.wire import Envelope, Keyring
from mlxceld.wire.address import HostPort, bound_identity, parse_address
from mlxceld.wire.assignment_messages import (
    REPLIES,
    Abort,
    Activate,
    Commit,
    Deactivated,
    Offer,
    Preparing,
    Refused,
)
from mlxceld.wire.messages import Message, MessageError

log = logging.getLogger(__name__)

PREPARE_S: Final = PEER_PHASE_S  # loading the stage in standby: past its last heartbeat
# A peer's wait between phases: PEER_PHASE_S; tests shorten it (MLXCELD_TEST_PEER_WAIT_S).
PHASE_S: Final = failpoints.PEER_WAIT_S or PEER_PHASE_S
JUDGE_S: Final = 10.0  # judging an offer, host name look-ups included


@dataclass
class _Current:
    """The round in progress and what it is about."""

    round: PeerRound
    coordinator: str
    stage: int
    toml: str
    stream: MxclStream | None = None
    refusal: Refusal | None = None


class Assignee:
    def __init__(self, assignments: Assignments, host: AssignedStage, keyring: Keyring, *,
                 identity: Callable[[], str], state_dir: Path, enabled: bool,
                 events: EventLog, leased: Leased | None = None) -> None:
        self._assignments = assignments
        self._leased = leased  # why an offer is refused for the lease's sake (None: not)
        self._events = events  # each recorded state is an event (assignment.STATE)
        self._host = host
        self._keyring = keyring
        self._identity = identity  # our agent address as it listens (a port 0 resolved)
        self._resolver = Resolver()  # a coordinator named by host name
        self._state_dir = state_dir
        self._enabled = enabled
        self._current: _Current | None = None
        self._tg: asyncio.TaskGroup | None = None  # a round's prepare and query, while running
        self._wake = asyncio.Event()
        self._closed = False
        self._preparing: asyncio.Task[None] | None = None

    def register(self, agent: AgentService) -> None:
        agent.add_handler(ASSIGNMENT_CHANNEL, "offer", self._on_offer)
        for kind in ("commit", "activate", "abort"):
            agent.add_handler(ASSIGNMENT_CHANNEL, kind, self._on_decision)
        agent.add_handler(ASSIGNMENT_CHANNEL, "deactivate", self._on_deactivate)

    def describe(self) -> dict[str, Any] | None:
        row = self._assignments.latest()
        if row is None:
            return None
        return {"epoch": row.epoch, "state": row.state, "stage": f"stage-{row.stage}",
                "coordinator": row.coordinator, "reason": row.reason}

    async def run(self) -> None:
        """Resume the latest assignment as its record left it, then keep the round's timer
        until ``close``; a round's prepare and query run in this one's task group
        (cancelled at ``close``)."""
        async with cancelling_group() as tg:
            self._tg = tg
            try:
                await self._resume()
                await self._keep_timer()
            finally:
                self._tg = None

    async def _resume(self) -> None:
        loop = asyncio.get_running_loop()
        row = self._assignments.latest()
        if row is not None and row.state == "active" and self._enabled:
            log.info("stage assignment %d is active: asking coordinator %s before resuming",
                     row.epoch, row.coordinator)
            decision, why = await ask_decision(self._identity(), row.coordinator, row.epoch,
                                               keyring=self._keyring)
            if decision == "deactivated":
                reason = "the coordinator deactivated the plan while this daemon was down"
                self._assignments.record(row.epoch, row.coordinator, row.stage, "deactivated",
                                         row.toml, reason)
                self._recorded(row.epoch, row.coordinator, row.stage, "deactivated", reason)
                log.info("stage assignment %d: not resumed: %s", row.epoch, reason)
                row = None
            elif decision is None:
                log.info("stage assignment %d: resuming without word from coordinator %s "
                         "(%s)", row.epoch, row.coordinator, why)
        if self._enabled and row is not None:
            r, actions = PeerRound.resume(row.epoch, PeerState.recorded(row.state),
                                          loop.time(), PHASE_S, row.reason)
            self._current = _Current(r, row.coordinator, row.stage, row.toml)
            if actions:
                log.info("resuming stage assignment %d (%s)", row.epoch, row.state)
            await self._execute(actions)

    async def _keep_timer(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            cur = self._current
            deadline = cur.round.deadline if cur else None
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._wake.wait()
            if cur is not None and cur is self._current and not self._closed:
                await self._execute(cur.round.handle_timer(loop.time()))

    def close(self) -> None:
        """End ``run`` (the daemon is shutting down); a round in progress ends with it."""
        self._closed = True
        self._wake.set()

    # -- handlers ---------------------------------------------------------------------------

    async def _on_offer(self, stream: MxclStream, env: Envelope) -> None:
        epoch = epoch_of(env.header) or 0
        if not self._enabled:
            await stream.send(sent(Refused(epoch, "not_a_peer", "this daemon does not take "
                                           "stage assignments; start it with --pp-peer",
                                           final=False)))
            return
        try:
            offer = Offer.from_wire(env.header)
        except MessageError as exc:
            await stream.send(sent(Refused(epoch, "bad_offer", exc.reason, final=False)))
            return
        newest = self._assignments.newest_epoch()  # SQLite stays on the loop's thread
        bound = bound_identity(stream.peer_identity, stream.peer)
        if self._leased and (held := await self._leased(bound, offer.epoch)) is not None:
            log.warning("offer %d from %s refused: lease: %s", offer.epoch, bound, held)
            await stream.send(sent(Refused(offer.epoch, "lease", held, final=False)))
            return
        try:
            async with asyncio.timeout(JUDGE_S):  # host names in the TOML are looked up
                verdict = await asyncio.to_thread(self._judge, offer, bound, newest)
        except TimeoutError:
            verdict = Refusal("listener", f"judging the offer took over {JUDGE_S:g} s "
                              "(looking up the host names in its cluster TOML)", False)
        if isinstance(verdict, Refusal) and verdict.code == "stale_epoch":
            log.warning("offer %d from %s refused: %s", offer.epoch, offer.coordinator,
                        verdict.reason)
            await stream.send(sent(Refused(offer.epoch, verdict.code, verdict.reason,
                                           final=False)))
            return
        if not await self._make_way(offer, stream, verdict):
            return
        loop = asyncio.get_running_loop()
        cur = _Current(PeerRound(offer.epoch, phase_s=PHASE_S), _dialable(offer, bound),
                       offer.stage, offer.toml, stream)
        self._current = cur
        self._wake.set()
        if isinstance(verdict, Refusal):
            log.warning("offer %d from %s refused: %s: %s", offer.epoch, offer.coordinator,
                        verdict.code, verdict.reason)
            cur.refusal = verdict
            await self._execute(cur.round.on_offer_refused(verdict.code, verdict.reason,
                                                           verdict.final))
            return
        log.info("offer %d from %s accepted: stage %d, layers %s", offer.epoch,
                 offer.coordinator, offer.stage, list(offer.layers))
        await self._execute(cur.round.on_offer_accepted(loop.time()))

    async def _make_way(self, offer: Offer, stream: MxclStream, verdict: Any) -> bool:
        """A round in progress meets another plan's offer (``PeerRound.on_other_offer``):
        True if the offer is to start its own round (the old one ended first), False if it
        was refused here."""
        cur = self._current
        if cur is None:
            return True
        valid = not isinstance(verdict, Refusal)
        outcome, actions = cur.round.on_other_offer(offer.epoch, valid)
        if outcome == "take":
            if actions:
                log.info("plan %d supersedes plan %d (undecided here)", offer.epoch,
                         cur.round.epoch)
                await self._execute(actions)
            return True
        if outcome == "keep":
            code, reason = verdict.code, verdict.reason
        elif outcome == "busy":
            code, reason = "busy", (f"plan {cur.round.epoch} is committed here; retry once "
                                    "it is active or aborted")
        else:
            code, reason = "stale_epoch", (f"plan epoch {offer.epoch} is not newer than "
                                           f"plan {cur.round.epoch}, in progress here")
        log.warning("offer %d from %s refused: %s: %s", offer.epoch, offer.coordinator, code,
                    reason)
        await stream.send(sent(Refused(offer.epoch, code, reason, final=False)))
        return False

    def _judge(self, offer: Offer, bound: HostPort, newest: int) -> Any:
        return judge(offer, self._host.facts(offer.port), bound_identity=bound,
                     newest_epoch=newest,
                     toml_path=self._state_dir / f"cluster-{offer.epoch}.toml")

    async def _on_decision(self, stream: MxclStream, env: Envelope) -> None:
        cur = self._current
        if cur is None or epoch_of(env.header) != cur.round.epoch:
            return  # another epoch's: ignored
        try:
            decision = _DECISIONS[env.type].from_wire(env.header)
        except MessageError as exc:
            log.warning("stage assignment %d: %s ignored: %s", cur.round.epoch, env.type, exc)
            return
        cur.stream = stream
        now = asyncio.get_running_loop().time()
        if isinstance(decision, Activate) and cur.round.state is PeerState.COMMITTED:
            failpoints.crash("peer-after-committed")
        if isinstance(decision, Commit):
            actions = cur.round.on_commit(now)
        elif isinstance(decision, Activate):
            actions = cur.round.on_activate()
        else:
            actions = cur.round.on_abort(decision.summary or "")
        self._wake.set()
        await self._execute(actions)

    async def _on_deactivate(self, stream: MxclStream, env: Envelope) -> None:
        epoch = epoch_of(env.header) or 0
        row = self._assignments.get(epoch)
        if row is None:
            await stream.send(sent(Deactivated(epoch, f"plan {epoch} never ran here")))
            return
        bound = bound_identity(stream.peer_identity, stream.peer)
        newer = self._assignments.latest()  # a standby that took the plan over offered it
        if not await self._resolver.is_node(row.coordinator, bound) and not (
                newer is not None and newer.epoch > epoch
                and await self._resolver.is_node(newer.coordinator, bound)):
            log.warning("deactivate %d from %s refused: plan %d came from %s", epoch, bound,
                        epoch, row.coordinator)
            await stream.send(sent(Refused(epoch, "coordinator", f"plan {epoch} came from "
                                           f"{row.coordinator}, not from {bound}", final=True)))
            return
        reason = f"deactivated by coordinator {row.coordinator}"
        cur = self._current
        if cur is not None and cur.round.epoch == epoch:
            log.info("stage assignment %d: %s", epoch, reason)
            cur.stream = stream
            self._wake.set()
            await self._execute(cur.round.on_deactivate(reason))
            return
        newest = self._assignments.newest_epoch()
        done = f"plan {epoch} was superseded here by plan {newest}; nothing of it ran"
        if epoch == newest:  # no round in memory (it ended before this daemon started)
            done = "nothing of it ran here"
            if row.state in HOLDS_A_STAGE:
                await self._host.stop_stage()
                done = "the stage is stopped"
        else:  # its stage kept serving while the plan after it came up (stagehost.py)
            done = await self._host.end_epoch(epoch) or done
        if row.state != "deactivated":
            self._assignments.record(epoch, row.coordinator, row.stage, "deactivated",
                                     row.toml, reason)
            self._recorded(epoch, row.coordinator, row.stage, "deactivated", reason)
            log.info("stage assignment %d: %s (%s)", epoch, reason, done)
        await stream.send(sent(Deactivated(epoch, done)))

    # -- actions ----------------------------------------------------------------------------

    async def _execute(self, actions: Sequence[PeerAction]) -> None:
        cur = self._current
        assert cur is not None
        for a in actions:
            if isinstance(a, Record):
                self._assignments.record(cur.round.epoch, cur.coordinator, cur.stage, a.state,
                                         cur.toml, a.reason)
                log.info("stage assignment %d: %s %s", cur.round.epoch, a.state, a.reason)
                self._recorded(cur.round.epoch, cur.coordinator, cur.stage, a.state, a.reason)
            elif isinstance(a, Reply):
                await self._reply(cur, a)
            elif isinstance(a, StageAction) and a.what == "prepare":
                self._preparing = self._spawn(self._prepare(cur), "prepare")
            elif isinstance(a, StageAction) and a.what == "activate":
                await self._stage_loaded()
                try:
                    await self._host.activate_stage()
                except MlxceldError as exc:  # the stage stays in standby
                    log.error("stage assignment %d: activating the stage failed: %s "
                              "(see: mlxctl logs stage)", cur.round.epoch, exc.message)
            elif isinstance(a, StageAction):
                await self._cancel_prepare()
                await self._host.stop_stage()
            elif isinstance(a, Query):
                self._spawn(self._query(cur), "query")

    def _recorded(self, epoch: int, coordinator: str, stage: int, state: str,
                  reason: str) -> None:
        """A state just written to ``assignments``, as an event (``assignment.STATE``)."""
        self._events.append(
            f"assignment.{state}", "stage", f"stage assignment {epoch} from {coordinator} "
            f"(stage {stage}): {state}" + (f": {reason}" if reason else ""),
            epoch=epoch, coordinator=coordinator, stage=stage, state=str(state),
            reason=reason)

    async def _reply(self, cur: _Current, a: Reply) -> None:
        said = self._said(cur, a)
        if cur.stream is None:
            return
        if a.kind == "active":
            await self._stage_loaded()  # a restarted round's stage runs before it says so
            failpoints.crash("peer-after-active")
        try:
            await cur.stream.send(sent(said))
        except ConnectionClosed:
            log.info("stage assignment %d: the coordinator's connection is gone (%s not "
                     "sent)", cur.round.epoch, a.kind)
            return
        if a.kind == "accepted":
            failpoints.crash("peer-after-accepted")

    def _said(self, cur: _Current, a: Reply) -> Message:
        """The message of the round's ``Reply``."""
        epoch = cur.round.epoch
        if a.kind == Refused.T:
            r = cur.refusal
            return Refused(epoch, r.code if r else "prepare", a.reason,
                           final=r.final if r else False)
        if a.kind != Preparing.T:
            return REPLIES[a.kind](epoch, a.reason)
        load = self._host.loading()
        if load is None:
            return Preparing(epoch, a.reason)
        return Preparing(epoch, a.reason, load["done"], load["total"],
                         round(max(0.0, time.time() - load["since"]), 1),
                         load.get("step", "loading"))

    async def _prepare(self, cur: _Current) -> None:
        """Load the stage in standby; an offer's (the round is preparing) says ``preparing``
        every ``HEARTBEAT_S`` meanwhile, a restarted round's loads it back quietly."""
        heartbeat = cur.round.state is PeerState.PREPARING
        # Not a task group (tasks.scoped_group included): awaited here between heartbeats
        # and only cancelled below, so an abort while the stage loads goes on at once. A
        # group would wait out the load's cancellation, and raise what the cancelled load
        # raised meanwhile out of the peer's round: with one, a good peer's daemon exited
        # instead of aborting once in CI (test_bringup_crash, a peer killed after accepted).
        task = asyncio.ensure_future(self._host.prepare_stage(
            cur.round.epoch, offered_node(cur.stage, cur.toml, self._identity()), cur.toml))
        try:
            while heartbeat and not task.done():
                await asyncio.wait({task}, timeout=HEARTBEAT_S)
                if not task.done():
                    cur.round.on_still_loading(asyncio.get_running_loop().time())
                    await self._reply(cur, Reply("preparing"))
            await task
        except MlxceldError as exc:
            if cur is self._current:
                await self._execute(cur.round.on_prepare_failed(exc.message))
            return
        finally:
            task.cancel()
        if cur.round.state is PeerState.PREPARING:
            failpoints.crash("peer-after-preparing")
        if cur is self._current:
            await self._execute(cur.round.on_prepared(asyncio.get_running_loop().time()))
            self._wake.set()

    async def _query(self, cur: _Current) -> None:
        decision, why = await ask_decision(self._identity(), cur.coordinator, cur.round.epoch,
                                           keyring=self._keyring)
        if cur is not self._current:
            return
        if decision is None:
            await self._execute(cur.round.on_query_failed(why))
        else:
            await self._execute(cur.round.on_decision(
                decision, asyncio.get_running_loop().time()))
        self._wake.set()

    async def _stage_loaded(self) -> None:
        """Wait for a stage still loading (a restarted round's: the coordinator's activate
        may come before it runs); ``AssignedStage.prepare_stage`` bounds it (by progress)."""
        task = self._preparing
        if task is not None and not task.done() and task is not asyncio.current_task():
            await asyncio.wait({task})

    async def _cancel_prepare(self) -> None:
        """An abort while the stage loads: stop loading before the stage is removed."""
        task = self._preparing
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait({task})

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None] | None:
        """``coro`` as a task of ``run``'s group; not started when ``run`` is not running
        (the daemon is shutting down)."""
        if self._tg is None:
            log.info("stage assignment: not running; the %s is not started", what)
            coro.close()
            return None
        return self._tg.create_task(coro)


_DECISIONS: Final = {kind.T: kind for kind in (Commit, Activate, Abort)}
Leased = Callable[[HostPort, int], Awaitable[str | None]]  # cluster/lease.py: Lease.refusal


def _dialable(offer: Offer, bound: HostPort) -> str:
    """Where to ask the coordinator (``Query``): the address it names itself by, or, when
    that is a wildcard, the address it reached us from (the judge checked they agree)."""
    try:
        named = parse_address(offer.coordinator)
    except ValueError:
        return str(bound)
    return str(bound) if named.is_wildcard else offer.coordinator
