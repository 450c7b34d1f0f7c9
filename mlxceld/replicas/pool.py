"""``ReplicaEngine``: one ``Engine`` over a pool of member engines, each a whole copy of
the model (a hybrid node reached by ``RemoteEngine``, or in tests a local engine).

Each request goes to one member, chosen by ``routing.py`` (least outstanding work,
with prefix affinity; its docstring says how both are measured), and that member's
tokens pass through unchanged. Closing the stream closes the member's (it cancels
the sequence there).

Members down. Only a member whose ``state()`` is "up" gets a new request. A member
that raises ``EngineUnavailable`` before its first token (it went down, or refused
as busy) has the request tried on the next best up member, each member at most
once; a member that refused as draining a moment ago (``_draining``: `mlxctl drain` of
that node) is chosen only when no other is up. A member that goes down after tokens were
streamed (its link broke or fell silent: a replica's host gone, a replica group's stage
lost) has the request continued on another up member, each member at most once: the
prompt and the tokens already sent prefilled there, decoding on, so the client reads one
answer (``engine/continuation.py``: greedy output is an unbroken run's; a request with
presence or frequency penalties, a constraint or a seeded sampler is not continued).
When no other member is up at that moment, the request waits up to ``CONTINUE_WAIT_S``
for one to come up (a member re-dialing a link that broke in the same event: a replica
group whose old stages stop beside its new ones on one host). Otherwise (no other member
up by then, none to wait for, such a request, or an error that is not the member's
going down: a drain's deadline, a fault of the request) the member's error passes on as
``EngineUnavailable`` (or ``EngineError``) naming the member by node id. When no member
is up, or every one refused, the request fails with ``EngineUnavailable`` naming each
member and why, with ``retry_after_s`` the least a refusing member asked for, else
``DOWN_RETRY_AFTER_S``: the API answers 503 with ``Retry-After``.

A member fails its own in-flight sequences when its link breaks or falls silent
(``RemoteEngine``'s ``silence_s``): the pool adds no deadline of its own to a
sequence, whose length only the client bounds (``max_tokens``).

Membership changes (a router finding its replicas by discovery). ``add`` puts a new
member in the pool (its keeper started if ``keep_linked`` runs); ``retire`` takes one
out: it gets no new request and leaves the stats once the sequences it holds end
(they finish, or fail as a down member's do and go on on another member by the rule
above: the pool adds no deadline to them); then its keeper is stopped and it is
closed. Until then its keeper runs (links re-dialed, handed over to a new key) for
those sequences. ``max_batch`` follows both. A node id is a member's for good: adding
one that is a member is refused; adding back a retired one (the same node, returned)
continues its account.

Addresses. A member's address is shown only in ``stats(verbose=True)``. Every error
the pool raises, and each member's ``last_error`` in the redacted stats, has
addresses replaced by ``<address>`` (``redaction.py``), the rest of the message kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from typing import Any, Literal, Protocol, cast

from mlxceld.engine import (
    Engine,
    EngineError,
    EngineUnavailable,
    GenerationRequest,
    TokenOutput,
)
from mlxceld.engine.continuation import Continuity, remainder, replayable
from mlxceld.replicas.redaction import scrub
from mlxceld.replicas.routing import Outcome, Routing
from mlxceld.tasks import Background

log = logging.getLogger(__name__)

DOWN_RETRY_AFTER_S = 2  # Retry-After when no member is up (none said when to come back)
CLOSE_S = 35.0  # how long aclose waits for each member's (a local engine's joins in 30 s)
# How long a request whose member went down midway waits for another member to come up
# (a link re-dialed takes well under a second on a LAN; a first dial of a group's new stages
# a few seconds on a loaded host), and how often it looks.
CONTINUE_WAIT_S = 10.0
CONTINUE_POLL_S = 0.1
MemberState = Literal["up", "connecting", "down"]


class Member(Engine, Protocol):
    """A pool member: an ``Engine`` with a stable ``node_id`` (shown in stats and
    errors), an ``address`` (shown only in verbose stats), a ``role`` ("hybrid"), its
    ``state()`` ("up", "connecting", "down") and its ``last_error()``. It may also have
    ``async keep_linked()`` (runs until cancelled) and ``rekey()``."""

    node_id: str
    address: str
    role: str

    def state(self) -> str: ...

    def last_error(self) -> str | None: ...


class ReplicaEngine:
    """Implements ``Engine`` over ``members``; its ``max_batch`` is the sum of theirs."""

    def __init__(self, members: Sequence[Member], *, model_id: str,
                 context_length: int, continue_wait_s: float = CONTINUE_WAIT_S) -> None:
        ids = [m.node_id for m in members]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a replica pool needs members with distinct node ids, not "
                             f"{ids}")
        self.model_id = model_id
        self.context_length = context_length
        self.max_batch = sum(m.max_batch for m in members)
        self.continue_wait_s = continue_wait_s
        self._continued = 0  # requests continued on another member (``continuity``)
        self._members = list(members)
        self._by_id = {m.node_id: m for m in members}
        self._routing = Routing({m.node_id: m.max_batch for m in members})
        self._sequences = itertools.count()
        self._refused = 0
        self._refusing = False
        self._retiring: dict[str, Member] = {}  # out of the pool, sequences still in flight
        # Retired members being closed: a close outlives the request that settled it, and
        # the pool has no scope of its own (it serves without keep_linked too).
        self._closing = Background(f"the replica pool of {model_id}")
        self._keepers: dict[str, asyncio.Task[None]] = {}
        self._retired_keepers: dict[str, asyncio.Task[None]] = {}  # until their close
        self._group: asyncio.TaskGroup | None = None

    # -- membership -------------------------------------------------------------------

    def members(self) -> list[Member]:
        return list(self._members)

    def add(self, member: Member) -> None:
        """``member`` joins the pool (``ValueError`` if its node id is a member)."""
        if member.node_id in self._by_id:
            raise ValueError(f"{member.node_id} is a member of the pool already")
        self._members.append(member)
        self._by_id[member.node_id] = member
        self._routing.add(member.node_id, member.max_batch)
        self.max_batch += member.max_batch
        if self._group is not None:
            self._keep(self._group, member)
        log.info("replica %s joined the pool", member.node_id)

    def retire(self, node_id: str) -> None:
        """``node_id`` leaves the pool: no new request; closed once its sequences end."""
        member = self._by_id.pop(node_id, None)
        if member is None:
            return
        self._members.remove(member)
        self.max_batch -= member.max_batch
        keeper = self._keepers.pop(node_id, None)
        if keeper is not None:  # kept for its sequences in flight: stopped in _settle
            _cancel(self._retired_keepers.pop(node_id, None))
            self._retired_keepers[node_id] = keeper
        self._retiring[node_id] = member
        log.info("replica %s retired from the pool (%d sequences in flight there)", node_id,
                 self._routing.nodes[node_id].in_flight)
        self._settle(node_id)

    def _settle(self, node_id: str) -> None:
        """A retired member with nothing in flight is closed and forgotten."""
        member = self._retiring.get(node_id)
        account = self._routing.nodes.get(node_id)
        if member is None or (account is not None and account.in_flight):
            return
        del self._retiring[node_id]
        _cancel(self._retired_keepers.pop(node_id, None))
        if node_id not in self._by_id:  # not added back meanwhile
            self._routing.drop(node_id)
        self._closing.spawn(self._close_member(member))

    def _keep(self, group: asyncio.TaskGroup, member: Member) -> None:
        """Start ``member``'s keeper in ``group`` (cancelling one ends it alone)."""
        run = getattr(member, "keep_linked", None)
        if callable(run):
            keeper = cast(Callable[[], Coroutine[Any, Any, None]], run)
            self._keepers[member.node_id] = group.create_task(keeper())

    # -- Engine -----------------------------------------------------------------------

    def active_sequences(self) -> int:
        return self._routing.in_flight()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        """The request on one member; one that goes down midway has it continued on
        another (``_continued``), each member at most once."""
        sent: list[int] = []
        gone: set[tuple[str, str]] = set()  # (node id, address) of the members it failed on
        while True:
            try:
                async with contextlib.aclosing(
                        self._attempt(remainder(request, sent), frozenset(gone))) as run:
                    async for out in run:
                        sent.append(out.token)
                        yield out
                return
            except _Continue as lost:
                gone.add(lost.member)
                self._continued += 1
                log.info("request %s: replica %s went down after %d token(s); continued on "
                         "another", request.request_id, lost.member[0], len(sent))

    async def _attempt(self, request: GenerationRequest, gone: frozenset[tuple[str, str]]
                       ) -> AsyncGenerator[TokenOutput, None]:
        seq = next(self._sequences)
        took, stream, first = await self._start(seq, request, gone)
        node = took[0]
        outcome: Outcome = "cancelled"
        error: str | None = None
        try:
            if first is None:
                outcome = "completed"
                return
            out: TokenOutput | None = first
            while out is not None:
                self._routing.token(seq, out.token)
                if out.finish_reason is not None:
                    outcome = "completed"  # before the yield: the caller may stop there
                yield out
                if outcome == "completed":
                    return
                out = await anext(stream, None)
            outcome = "completed"  # the member ended it without a finish reason
        except EngineError as exc:
            outcome = "failed"
            error = str(exc)  # as it is: stats scrub it unless verbose
            if await self._continues(took, request, seq, exc, gone):
                outcome = "retried"
                raise _Continue(took) from exc
            raise self._midway(node, seq, exc) from exc
        except Exception as exc:
            outcome = "failed"
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._routing.end(seq, outcome, error)
            await self._close(stream)
            self._settle(node)

    async def aclose(self) -> None:
        """Close every member, at once, each within ``CLOSE_S`` (one that does not is
        logged and left)."""
        await asyncio.gather(*(self._close_member(m)
                               for m in [*self._members, *self._retiring.values()]))
        self._retiring.clear()
        await self._closing.aclose(within_s=None)  # each close is bounded by CLOSE_S

    async def _close_member(self, member: Member) -> None:
        try:
            async with asyncio.timeout(CLOSE_S):
                await member.aclose()
        except TimeoutError:
            log.warning("replica %s did not close within %s s; left behind", member.node_id,
                        CLOSE_S)
        except Exception as exc:
            log.warning("replica %s did not close cleanly: %s", member.node_id,
                        self._scrub(str(exc)))

    # -- the pool's own -------------------------------------------------------------------

    def stats(self, *, verbose: bool) -> dict[str, Any]:
        """The body of ``GET /router/stats``: per member and in all. Without ``verbose``
        no address is in it (members by node id; errors scrubbed). A member's
        ``dispatched`` counts every try there: it is ``in_flight`` plus ``completed``,
        ``cancelled``, ``failed`` and ``retried`` (refused before its first token);
        ``refused``: the requests no member could take."""
        nodes: list[dict[str, Any]] = []
        totals = dict.fromkeys(("in_flight", "outstanding_tokens", "dispatched", "completed",
                                "cancelled", "failed", "retried"), 0)
        retiring = [m for m in self._retiring.values() if m.node_id not in self._by_id]
        for member in [*self._members, *retiring]:  # one account per node id
            account = self._routing.nodes[member.node_id]
            error = member.last_error() or account.last_error
            node: dict[str, Any] = {
                "id": member.node_id, "role": member.role, "state": member.state(),
                "in_flight": account.in_flight,
                "outstanding_tokens": account.outstanding_tokens,
                "dispatched": account.dispatched, "completed": account.completed,
                "cancelled": account.cancelled, "failed": account.failed,
                "retried": account.retried, "affinity_hits": account.affinity_hits,
                "affinity_tokens": account.affinity_tokens,
                "last_error": error if verbose or error is None else self._scrub(error),
            }
            if member.node_id in self._retiring:
                node["retired"] = True  # out of the pool, its sequences still running
            if verbose:
                node["address"] = member.address
            nodes.append(node)
            for key in totals:
                totals[key] += node[key]
        return {"addresses_redacted": not verbose, "model": self.model_id,
                "up": sum(n["state"] == "up" for n in nodes), "nodes": nodes, **totals,
                "refused": self._refused}

    async def keep_linked(self) -> None:
        """Each member's ``keep_linked()`` (those that have one), until cancelled. One
        that fails (a bug: a keeper outlives its link's errors) ends the others and
        raises, for the worker to exit and its supervisor to restart it. A member added
        meanwhile has its keeper started; a retired one's is cancelled."""
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for member in self._members:
                    self._keep(group, member)
                await asyncio.Event().wait()  # until cancelled
        finally:
            self._group = None
            self._keepers.clear()
            self._retired_keepers.clear()

    def continuity(self) -> Continuity:
        """What became of requests whose member went down midway, for ``/metrics``."""
        return Continuity(continued_total=self._continued)

    def readiness(self) -> dict[str, Any] | None:
        """None while a member is up; else what is wrong (for ``/ready``'s 503)."""
        if any(m.state() == "up" for m in self._members):
            return None
        if not self._members:
            return {"message": "no replica is up: none is known yet (a router finding its "
                    "replicas by discovery adds each once its agent says it serves the "
                    "model)", "nodes": []}
        return {"message": f"no replica is up: {self._why_not({})}",
                "nodes": [{"id": m.node_id, "state": m.state()} for m in self._members]}

    def rekey(self) -> None:
        """Each member's ``rekey()`` (those that have one): the cluster secret changed."""
        for member in [*self._members, *self._retiring.values()]:
            rekey = getattr(member, "rekey", None)
            if callable(rekey):
                rekey()

    # -- inside ---------------------------------------------------------------------------

    async def _start(self, seq: int, request: GenerationRequest,
                     gone: frozenset[tuple[str, str]]
                     ) -> tuple[tuple[str, str], AsyncGenerator[TokenOutput, None],
                                TokenOutput | None]:
        """The member that took the request (its node id, and its address then: a moved
        group keeps its id, and a member may be retired before its first token), its
        stream and its first output (None: it ended with none). A member refusing before
        its first token is passed over, and so is one in ``gone`` (it failed this request
        midway)."""
        prompt = request.prompt_tokens
        hashes = self._routing.hashes(prompt)
        refused: dict[str, EngineUnavailable] = {}
        while True:
            up = []
            for member in self._members:
                if member.state() != "up":
                    self._routing.nodes[member.node_id].shadow.clear()  # its cache may be gone
                elif (member.node_id not in refused
                      and (member.node_id, member.address) not in gone):
                    up.append(member.node_id)
            ready = [i for i in up if not _draining(self._by_id[i])]
            choice = self._routing.choose(prompt, ready or up, hashes)
            if choice is None:
                raise self._unavailable(refused)
            member = self._by_id[choice.node_id]
            took = (member.node_id, member.address)
            self._routing.dispatch(seq, choice, prompt, request.params.max_tokens)
            stream = member.generate(request)
            try:
                first = await anext(stream, None)
            except EngineUnavailable as exc:
                await self._close(stream)
                refused[member.node_id] = exc
                self._routing.end(seq, "retried", str(exc))
                self._settle(member.node_id)
                log.info("replica %s refused request %s before its first token (%s); "
                         "trying another", member.node_id, request.request_id,
                         self._scrub(str(exc)))
                continue
            except BaseException as exc:  # its own fault (a bad constraint), or cancelled
                await self._close(stream)
                # an EngineError is the member's: its last error; a request it could
                # not take (a ValueError: a bad constraint) is the client's
                failed = isinstance(exc, Exception)
                self._routing.end(seq, "failed" if failed else "cancelled",
                                  str(exc) if isinstance(exc, EngineError) else None)
                self._settle(member.node_id)
                raise
            if self._refusing:
                self._refusing = False
                log.info("replicas take requests again (%s took %s)", member.node_id,
                         request.request_id)
            return took, stream, first

    def _unavailable(self, refused: dict[str, EngineUnavailable]) -> EngineUnavailable:
        self._refused += 1
        why = self._why_not(refused)
        if not self._refusing:
            self._refusing = True
            log.warning("no replica can take requests now: %s", why)
        retry = min((e.retry_after_s for e in refused.values()), default=DOWN_RETRY_AFTER_S)
        return EngineUnavailable(f"no replica can take the request now: {why}; retry in "
                                 f"{retry} s", retry_after_s=retry)

    def _why_not(self, refused: dict[str, EngineUnavailable]) -> str:
        if not self._members:
            return "none is known yet"
        parts = []
        for member in self._members:
            if member.node_id in refused:
                parts.append(f"{member.node_id} refused "
                             f"({self._scrub(str(refused[member.node_id]))})")
                continue
            state = member.state()
            error = member.last_error() or self._routing.nodes[member.node_id].last_error
            detail = f" ({self._scrub(error)})" if error else ""
            parts.append(f"{member.node_id} {state}{detail}")
        return ", ".join(parts)

    async def _continues(self, took: tuple[str, str], request: GenerationRequest, seq: int,
                         exc: EngineError, gone: frozenset[tuple[str, str]]) -> bool:
        """Whether a request that the member ``took`` (its node id and address when it
        took it) failed midway goes on on another member: that member is down (its link
        broke or fell silent: not a drain's deadline, not a fault of the request), or is
        no longer what it was (retired from the pool, or a replica group moved to another
        plan's stages: what it ran on is stopping); the request can continue exactly
        (``engine/continuation.py``); and another member is up, now or within
        ``continue_wait_s``."""
        member = self._by_id.get(took[0])
        replaced = member is None or member.address != took[1]
        if not isinstance(exc, EngineUnavailable) or (not replaced and member is not None
                                                      and member.state() == "up"):
            return False
        if not replayable(request.params, self._routing.generated(seq)):
            return False
        out = gone | {took}

        def others() -> list[Member]:
            return [m for m in self._members if (m.node_id, m.address) not in out]

        deadline = asyncio.get_running_loop().time() + self.continue_wait_s
        while not any(m.state() == "up" for m in others()):
            if not others() or asyncio.get_running_loop().time() >= deadline:
                log.info("request %s: no other replica up within %g s to go on on (%s)",
                         request.request_id, self.continue_wait_s,
                         ", ".join(f"{m.node_id} {m.state()}" for m in others()) or "none")
                return False
            await asyncio.sleep(CONTINUE_POLL_S)
        return True

    def _midway(self, node: str, seq: int, exc: EngineError) -> EngineError:
        n = self._routing.generated(seq)
        message = (f"replica {node!r} failed after {n} token{'s' * (n != 1)} of this "
                   f"answer: {self._scrub(str(exc))}")
        log.warning("%s", message)
        if isinstance(exc, EngineUnavailable):
            return EngineUnavailable(message, retry_after_s=exc.retry_after_s)
        return EngineError(message)

    def _scrub(self, text: str) -> str:
        return scrub(text, (m.address for m in [*self._members, *self._retiring.values()]))

    @staticmethod
    async def _close(stream: AsyncGenerator[TokenOutput, None]) -> None:
        with contextlib.suppress(Exception):  # it failed already: its error was told
            await stream.aclose()


def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()


def _draining(member: Member) -> bool:
    """Whether ``member`` refused a request as draining a moment ago (a ``RemoteEngine``'s
    ``draining_until``, on the loop's clock; a member without one never does)."""
    until = getattr(member, "draining_until", 0.0)
    return isinstance(until, float) and asyncio.get_running_loop().time() < until


class _Continue(Exception):
    """A member went down midway through a request that can go on on another."""

    def __init__(self, member: tuple[str, str]) -> None:
        super().__init__(member[0])
        self.member = member  # its node id and address
