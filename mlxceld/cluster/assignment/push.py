"""The two-phase stage assignment on MXCL channel 2: its messages and the coordinator's push.

Messages (the envelope of PROTOCOL.md section 4, header only, no tensors; every
one carries ``epoch``, the plan's; anything about another epoch is ignored), each a
frozen dataclass in ``wire/assignment_messages.py``:

=========== ================ ===================================================
type        direction        fields
=========== ================ ===================================================
offer       coord → peer     ``Offer`` (judged in ``offers.py``): the stage, its
                             layers, port, node id and the cluster TOML (a 2D
                             mesh's: the peer's rank in its stage's group and
                             the group's agents, one offer to each rank)
preparing   peer → coord     a heartbeat every ``HEARTBEAT_S`` while the
                             peer loads its stage in standby; ``done``,
                             ``total`` (bytes), ``elapsed_s`` once its stage
                             says how far its load is, and ``step``
                             (``downloading`` or ``loading``) (optional)
accepted    peer → coord     none: the stage is loaded; the vote is durable
refused     peer → coord     ``code``, ``reason``, ``final`` (bool; ``offers``)
commit      coord → peer     none: every peer accepted (the decision is durable)
committed   peer → coord     none
activate    coord → peer     none: every peer committed; re-sent until active
active      peer → coord     none: the stage serves
abort       coord → peer     ``summary``: each peer that did not commit, and why
aborted     peer → coord     ``reason`` (optional): the standby stage is gone
query       either way       none: "what did you decide for this epoch?"
decision    answer to query  ``decision``: commit | activate | active | abort |
                             deactivated | unknown (never heard of it)
deactivate  coord → peer     ``reason``: the plan ended (`mlxctl cluster
                             deactivate`; any state, after the round)
deactivated peer → coord     ``reason``: what was done; the stage is stopped and
                             the assignment recorded deactivated
=========== ================ ===================================================

The offer and everything after it travel on one connection the coordinator
dials to the peer's agent listener (identity: the coordinator's agent address);
a peer's ``query`` (``peer_round.Query``) dials the coordinator's, and so does a
peer that restarts with an active assignment, before it brings the stage back
(``peer``). ``deactivate`` travels on a connection of its own
(``deactivation.py``); a peer refuses it (``refused``, code ``coordinator``)
from anyone but the coordinator that offered the plan.

A peer whose connection is lost after the coordinator decided commit or activate
is re-dialled (``_Links``): every ``coordinator_round.RESEND_S`` the decision goes
again, over its connection or a new one, to each peer that has not answered it,
within the commit window for ``commit`` and for ``coordinator_round.ACTIVATE_FOR_S``
after ``activate`` (a peer that restarts answers from its record,
``peer_round.PeerRound.resume``). Lost before the decision, a peer's vote cannot be
asked again: the plan is aborted.

Bounds: ``CONNECT_S`` per dial and handshake (one dial at a time per peer),
``peer_round.FRAME_S`` per answer, ``coordinator_round.PUSH_S`` for the push up to the
activate decision with ``COMMIT_WINDOW_S`` left for the commit phase, then
``ACTIVATE_FOR_S`` (``ACTIVATING_S``: tests shorten it with ``MLXCELD_TEST_ACTIVATE_FOR_S``,
see ``mlxceld.failpoints``); ``RESEND_S`` between two re-sends or re-dials;
``peer_round.PEER_PHASE_S`` for a peer's waits between phases, ``LATE_DECISION_S`` for
a decision to a peer whose connection came up after it. Each connection of the push has
a heartbeat (``net/liveness.watch``): a peer that sends nothing, not even a pong, for
``SILENCE_S`` (3 s; a stopped process, a host asleep: no RST) has its connection ended
and read as lost, so that the round re-dials it rather than writing its decisions into
a socket nobody reads (the peer's agent listener pings us back the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from mlxceld import __version__, failpoints
from mlxceld.cluster.assignment.coordinator_round import (
    ACTIVATE_FOR_S,
    PUSH_S,
    CoordinatorRound,
    Finished,
    PeerLoad,
    Persist,
    Redial,
    Send,
)
from mlxceld.cluster.assignment.offers import ASSIGNMENT_VERSION
from mlxceld.cluster.clusterfile.load import dump_cluster, parse_cluster_text
from mlxceld.cluster.plan.candidates import Proposal
from mlxceld.net import ConnectionClosed, HandshakeFailed, MxclStream, connect_as
from mlxceld.net.liveness import watch
from mlxceld.state.plans import Plans
from mlxceld.tasks import scoped_group
from mlxceld.types import DEFAULT_SILENCE_S
from mlxceld.wire import Keyring, MessageSpec, encode_envelope
from mlxceld.wire.assignment_messages import (
    FROM_COORDINATOR,
    FROM_PEER,
    Abort,
    Aborted,
    Accepted,
    Activate,
    Active,
    Commit,
    Committed,
    Decision,
    Offer,
    Preparing,
    Refused,
)
from mlxceld.wire.envelope import parse_envelope
from mlxceld.wire.errors import EnvelopeError
from mlxceld.wire.messages import Error, Message, decode

log = logging.getLogger(__name__)

Watch = Callable[[CoordinatorRound], None]  # sees the round after every step (progress)

ASSIGNMENT_CHANNEL: Final = 2
CONNECT_S: Final = 5.0  # one dial and handshake
# A decision for a peer whose connection came up only after it was made, sent as the push
# ends: short, as push's caller waits on it; a peer that misses it still learns the decision
# by its query after its own wait (PEER_PHASE_S).
LATE_DECISION_S: Final = 1.0
HEARTBEAT_S: Final = 2.0  # a preparing peer's heartbeat
# A push's connection whose peer sent nothing, not even a pong, for this long is lost (the
# peer asleep or stopped: no RST); the round re-dials it, or aborts before its decision.
SILENCE_S: Final = DEFAULT_SILENCE_S
# After activate is written, how long a push keeps at a peer that is not active:
# ACTIVATE_FOR_S; tests shorten it (MLXCELD_TEST_ACTIVATE_FOR_S).
ACTIVATING_S: Final = failpoints.ACTIVATE_FOR_S or ACTIVATE_FOR_S
COORDINATOR_SPECS: Final = {t: MessageSpec() for t in FROM_PEER}  # what a coordinator reads
PEER_SPECS: Final = {t: MessageSpec() for t in (*FROM_COORDINATOR, Decision.T)}


def decided(kind: str, epoch: int, summary: str | None = None) -> Commit | Activate | Abort:
    """The message of a coordinator's decision (``Send.kind``, ``Redial.kind``)."""
    if kind == Abort.T:
        return Abort(epoch, summary)
    return Commit(epoch) if kind == Commit.T else Activate(epoch)


def sent(message: Message) -> bytes:
    return encode_envelope(message.to_wire())


def epoch_of(header: Mapping[str, Any]) -> int | None:
    epoch = header.get("epoch")
    return epoch if type(epoch) is int else None


@dataclass(frozen=True)
class StageOffer:
    """One stage of a plan: the peer agent that runs it and what it is offered."""

    agent: str  # the peer's agent address (host:port)
    stage: int
    layers: tuple[int, int]
    node_id: str
    port: int  # its stage listener's (0: a rank past 0 of a stage's group, none)
    tp_rank: int = 0  # its rank in its stage's tensor group across hosts (a 2D mesh)
    tp_group: tuple[str, ...] = ()  # that group's agents in rank order; (): no group


@dataclass(frozen=True)
class PushPlan:
    cluster: str
    model_identity: str
    toml: str
    stages: tuple[StageOffer, ...]
    mesh: str | None = None  # the --mesh it was planned with, recorded (state/plans.py)


def push_plan(cluster: str, proposal: Proposal, mesh: str | None = None) -> PushPlan:
    """What the push offers: each stage to the agent of the node it was planned on; a
    stage that is a tensor group (a 2D mesh) to each of its ranks' agents, with the group
    (rank 0 runs the stage, ``stage-K``; rank r is ``stage-K-tp-r``, no listener); and
    ``mesh``, the --mesh to record it with (None: not known)."""
    offers: list[StageOffer] = []
    for s in proposal.plan.stages:
        group = tuple(n.key for n in s.ranks) if s.tp_nodes else ()
        offers += [StageOffer(n.key, s.index, s.layers, s.stage_id + (f"-tp-{r}" if r else ""),
                              n.stage_port if r == 0 else 0, r, group)
                   for r, n in enumerate(s.ranks)]
    return PushPlan(cluster, proposal.model_identity, proposal.toml, tuple(offers), mesh)


def offer_for(plan: PushPlan, s: StageOffer, epoch: int, coordinator: str) -> Offer:
    offer = Offer(epoch=epoch, assignment_version=ASSIGNMENT_VERSION,
                  package_version=__version__, cluster=plan.cluster,
                  model_identity=plan.model_identity, stage=s.stage, layers=s.layers,
                  node_id=s.node_id, port=s.port, coordinator=coordinator, toml=plan.toml,
                  tp_rank=s.tp_rank, tp_group=s.tp_group)
    return _faulty(offer) if failpoints.ACTIVE & failpoints.FAULT_POINTS else offer


def _faulty(offer: Offer) -> Offer:
    """The offer as the fault points set (``mlxceld.failpoints``, tests only) bend it."""
    if failpoints.on("offer-assignment-version"):
        offer = replace(offer, assignment_version=0)
    if failpoints.on("offer-package-version"):
        offer = replace(offer, package_version=f"{offer.package_version}+failpoint")
    if failpoints.on("offer-coordinator"):
        offer = replace(offer, coordinator="127.0.0.254:19000")
    if failpoints.on("offer-layer-count"):
        cfg = parse_cluster_text(offer.toml, Path("offer.toml"))
        last = cfg.stages[-1]
        assert last.layers is not None
        layers = (last.layers[0], last.layers[1] + 1)
        cfg = replace(cfg, nodes=tuple(replace(n, layers=layers) if n is last else n
                                       for n in cfg.nodes))
        offer = replace(offer, toml=dump_cluster(cfg),
                        layers=layers if offer.stage == last.rank else offer.layers)
    return offer


async def push(plan: PushPlan, *, plans: Plans, keyring: Keyring, identity: str,
               push_s: float = PUSH_S, epoch: int | None = None,
               watch: Watch | None = None) -> tuple[int, Finished]:
    """Offer every stage, then commit and activate, or abort everywhere; the decision is
    written to ``plans`` before it is sent. Returns the epoch (``epoch``, taken from
    ``plans.next_epoch()`` by the caller, or here) and how it ended."""
    epoch = plans.next_epoch() if epoch is None else epoch
    peers = tuple(s.agent for s in plan.stages)
    plans.create(epoch, plan.cluster, plan.model_identity, peers, plan.toml, plan.mesh)
    loop = asyncio.get_running_loop()
    round_ = CoordinatorRound(epoch, peers, loop.time(), push_s=push_s,
                              activate_for_s=ACTIVATING_S)
    log.info("plan %d: offering %d stage(s) to %s", epoch, len(peers), ", ".join(peers))
    round_.start()  # the offers go out as each connection is up
    first = {s.agent: sent(offer_for(plan, s, epoch, identity)) for s in plan.stages}
    return epoch, await _drive(round_, first, plans=plans, keyring=keyring, identity=identity,
                               watch=watch)


async def resume_push(epoch: int, *, plans: Plans, keyring: Keyring, identity: str,
                      watch: Watch | None = None, why: str = "after a restart") -> Finished:
    """A coordinator restarted after deciding commit or activate (or asked by a peer after
    a push that stalled: ``why``): re-send the decision (idempotent) to every peer over
    fresh connections until every peer is active."""
    row = plans.get(epoch)
    assert row is not None and row.decision in ("commit", "activate")
    round_, actions = CoordinatorRound.resume(epoch, row.peers, row.decision,  # type: ignore[arg-type]
                                              asyncio.get_running_loop().time(), ACTIVATING_S)
    log.info("plan %d: resuming the push, %s (%s)", epoch, why, row.decision)
    first = {a.peer: sent(decided(a.kind, epoch)) for a in actions if isinstance(a, Send)}
    return await _drive(round_, first, plans=plans, keyring=keyring, identity=identity,
                        watch=watch)


async def _drive(round_: CoordinatorRound, first: Mapping[str, bytes], *, plans: Plans,
                 keyring: Keyring, identity: str, watch: Watch | None = None) -> Finished:
    """One connection per peer at a time (``first`` goes out on the first; ``_Links``), a
    reader each feeding the round, its actions carried out in order, until it finishes.
    The readers are the round's tasks: none outlives it, and one that fails ends it."""
    async with scoped_group() as tg:
        links = _Links(round_.epoch, identity, keyring, tg)
        return await _driven(round_, first, links, plans=plans, watch=watch)


async def _driven(round_: CoordinatorRound, first: Mapping[str, bytes], links: _Links, *,
                  plans: Plans, watch: Watch | None) -> Finished:
    loop = asyncio.get_running_loop()
    epoch = round_.epoch

    async def execute(actions: Sequence[object]) -> Finished | None:
        for a in actions:
            if isinstance(a, Persist):
                if a.decision == "commit":
                    failpoints.crash("coordinator-before-decision")
                plans.decide(epoch, a.decision, a.summary)
                log.info("plan %d: decided %s %s", epoch, a.decision, a.summary)
            elif isinstance(a, Send | Redial):
                if a.kind in ("commit", "activate", "abort"):
                    failpoints.crash(f"coordinator-after-{a.kind}-decision")
                summary = a.summary if isinstance(a, Send) and a.kind == Abort.T else None
                payload = sent(decided(a.kind, epoch, summary))
                await (links.redial if isinstance(a, Redial) else links.send)(a.peer, payload)
            elif isinstance(a, Finished):
                if a.ok:
                    failpoints.crash("coordinator-after-active-decision")
                return a
        return None

    for peer, payload in first.items():
        links.open(peer, payload)
    try:
        if watch is not None:
            watch(round_)
        while True:
            deadline = round_.next_deadline()
            try:
                async with asyncio.timeout_at(deadline):
                    peer, heard, link = await links.inbox.get()
            except TimeoutError:
                actions = round_.handle_timer(loop.time())
            else:
                if isinstance(heard, Lost) and not links.lose(peer, link):
                    continue  # that connection's loss was heard already
                actions = _feed(round_, peer, heard, loop.time())
            done = await execute(actions)
            if watch is not None:
                watch(round_)
            if done is not None:
                return done
    finally:
        await links.aclose()


@dataclass(frozen=True)
class Lost:
    """A push's connection to a peer is lost (or could not be dialled): why."""

    reason: str


Heard = Message | Lost  # what a push's reader hands the round


@dataclass(eq=False)
class _Link:
    """One connection to a peer, from its dial on; its reader feeds ``_Links.inbox``."""

    task: asyncio.Task[None] | None = None
    stream: MxclStream | None = None
    lost: bool = False


class _Links:
    """The push's connections, one per peer at a time, each dialled with its first message
    and read into ``inbox`` as (peer, type, header, link); ``lost`` once it closes or
    cannot be dialled (``CONNECT_S``). The round re-dials a lost peer (``Redial``).

    A ``send`` to a peer still connecting is skipped, but its message is kept: should
    that dial still come up and deliver its first message before the round finishes (it
    connects while another send is under way), the peer hears the message after all,
    best effort and within ``LATE_DECISION_S``, before its connection is closed. A peer
    still connecting when the round finishes is not waited for: its dial is cancelled,
    and nothing went out to it. A ``send`` to a peer whose connection is lost is
    dropped: the round hears of the loss, and re-dials it or not."""

    def __init__(self, epoch: int, identity: str, keyring: Keyring,
                 tg: asyncio.TaskGroup) -> None:
        """``tg``: the round's, where each link's reader runs."""
        self._tg = tg
        self.inbox: asyncio.Queue[tuple[str, Heard, _Link]] = asyncio.Queue()
        self._epoch = epoch
        self._identity = identity
        self._keyring = keyring
        self._by_peer: dict[str, _Link] = {}
        self._all: list[_Link] = []
        self._unsent: dict[str, bytes] = {}  # the last send skipped per peer: dialling

    def open(self, peer: str, first: bytes) -> None:
        """Dial ``peer`` (in a task of its own) and send ``first`` once connected."""
        again = peer in self._by_peer
        # Forget the links that are over (lost, their task done): a peer down for the
        # whole ACTIVATE_FOR_S is dialled every RESEND_S, and nothing of those dials stays.
        self._all = [k for k in self._all if not (k.lost and k.task is not None
                                                   and k.task.done())]
        link = _Link()
        link.task = self._tg.create_task(self._run(peer, first, link, again))
        self._by_peer[peer] = link
        self._all.append(link)

    def lose(self, peer: str, link: _Link) -> bool:
        """A ``lost`` from ``link``: True if it is news (the peer's current connection,
        not yet lost), and then it is marked lost."""
        if self._by_peer.get(peer) is not link or link.lost:
            return False
        link.lost = True
        return True

    async def send(self, peer: str, payload: bytes) -> None:
        link = self._by_peer.get(peer)
        if link is None or link.lost:
            return
        if link.stream is None:
            self._unsent[peer] = payload
            return
        self._unsent.pop(peer, None)
        try:
            await link.stream.send(payload)
        except ConnectionClosed as exc:
            await self.inbox.put((peer, Lost(f"connection lost: {exc}"), link))

    async def redial(self, peer: str, payload: bytes) -> None:
        """``payload`` over a new connection if the peer's is lost; over its connection if
        that is up; nothing while a dial is under way (the round sends again later)."""
        link = self._by_peer.get(peer)
        if link is None or link.lost:
            log.debug("plan %d: dialling %s again", self._epoch, peer)
            self.open(peer, payload)
        elif link.stream is not None:
            await self.send(peer, payload)

    async def aclose(self) -> None:
        tasks = [link.task for link in self._all if link.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A dial cancelled inside connect sent nothing; one that got a stream also sent its
        # first message (no await in between), so the peer must hear what it missed.
        late = [(link.stream, m) for p, m in self._unsent.items()
                if (link := self._by_peer[p]).stream is not None and not link.lost]
        await asyncio.gather(*(_send_late(stream, m) for stream, m in late))
        for link in self._all:
            if link.stream is not None:
                await link.stream.close("assignment over")

    async def _run(self, peer: str, first: bytes, link: _Link, again: bool) -> None:
        try:
            stream = await connect_as(self._identity, peer, keyring=self._keyring,
                                      channel=ASSIGNMENT_CHANNEL, budget_s=CONNECT_S)
        except HandshakeFailed as exc:
            await self.inbox.put((peer, Lost(f"cannot connect: {exc.message}"), link))
            return
        link.stream = stream
        if again:
            log.info("plan %d: connected to %s again", self._epoch, peer)
        try:
            async with scoped_group() as tg:
                # The heartbeat ends the stream of a peer silent for SILENCE_S (the recv
                # below then raises); it ends with this reader.
                tg.create_task(watch(stream, SILENCE_S, f"plan {self._epoch}'s peer {peer}"))
                await stream.send(first)
                while True:
                    env = parse_envelope(await stream.recv(), COORDINATOR_SPECS)
                    if epoch_of(env.header) == self._epoch or env.type == Error.T:
                        await self.inbox.put((peer, decode(env.header, FROM_PEER), link))
        except (ConnectionClosed, EnvelopeError) as exc:  # a MessageError is one
            await self.inbox.put((peer, Lost(f"connection lost: {exc}"), link))
            await stream.close("connection lost")


def peer_load(heard: Preparing) -> PeerLoad | None:
    """A ``preparing`` heartbeat's load (``done``, ``total``, ``elapsed_s``); None when it
    has none, or one that does not add up (ignored: it is for the operator's eyes only)."""
    done, total, elapsed = heard.done, heard.total, heard.elapsed_s
    if not (isinstance(done, int) and isinstance(total, int)
            and isinstance(elapsed, int | float)) or any(
                isinstance(v, bool) for v in (done, total, elapsed)):
        return None
    if not (0 <= done <= total and 0 <= elapsed < 1e9):
        return None
    step = "downloading" if heard.step == "downloading" else "loading"
    return PeerLoad(done, total, float(elapsed), step)


async def _send_late(stream: MxclStream, payload: bytes) -> None:
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        async with asyncio.timeout(LATE_DECISION_S):
            await stream.send(payload)


def _feed(r: CoordinatorRound, peer: str, heard: Heard, now: float) -> list[Any]:
    if isinstance(heard, Preparing):
        return r.on_preparing(peer, now, peer_load(heard))
    if isinstance(heard, Accepted):
        return r.on_accepted(peer, now)
    if isinstance(heard, Committed):
        return r.on_committed(peer, now)
    if isinstance(heard, Active):
        return r.on_active(peer, now)
    if isinstance(heard, Refused):
        return r.on_refused(peer, f"{heard.code}: {heard.reason}")
    if isinstance(heard, Lost):
        return r.on_lost(peer, heard.reason)
    if isinstance(heard, Error):
        return r.on_failed(peer, f"protocol error: {heard.reason}")
    if isinstance(heard, Aborted):
        return r.on_failed(peer, f"aborted: {heard.reason}" if heard.reason else "aborted")
    return []
