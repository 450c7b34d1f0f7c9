"""Draining: nodes this router needs that admit no new request, and the deadline of the rest.

The daemon says which of the nodes the router's requests need (its own, for a
local engine; the coordinator's and every stage's, for a pipeline) are draining,
and until when (``set``; ``mlxctl drain``). While any is:

- a new completion is refused at once with 503, ``Retry-After: RETRY_AFTER_S`` and
  code ``draining``, its message naming the node (never an address) and how the
  drain ends;
- a request admitted before runs to completion;
- at the drain's deadline (at once with ``--force``) every request still running
  ends with a clear error (503, code ``drain_deadline``; an SSE error event once its
  stream has begun). A request notices the deadline at once while it waits for its
  next token, if the drain was set before that wait began; one whose wait began
  earlier notices it at its next token.

``set([])`` (``mlxctl undrain``) admits again and disarms the deadline. The counts
(``in_flight``, ``finished``, ``ended``) are what the daemon's drain reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mlxceld.api.errors import ApiError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # what a refused client is told to wait: a drain lasts a while

T = TypeVar("T")


@dataclass(frozen=True)
class NodeDrain:
    node: str  # the node id, as `mlxctl cluster nodes` names it
    deadline: float | None  # unix s; None: no deadline (until undrained)


def parse_drains(request: Mapping[str, Any]) -> list[NodeDrain]:
    """A worker's ``drain`` op's ``{"drains": [{"node": ID, "deadline": UNIX-S or null},
    ...]}``, every drain in force (``[]``: none); ``ValueError`` saying what is wrong."""
    raw = request.get("drains")
    if not isinstance(raw, list):
        raise ValueError("'drains' must be a list")
    drains = []
    for item in raw:
        node = item.get("node") if isinstance(item, dict) else None
        deadline = item.get("deadline") if isinstance(item, dict) else None
        if not isinstance(node, str) or not (deadline is None or isinstance(deadline, float | int)):
            raise ValueError("each drain must be {'node': ID, 'deadline': UNIX-S or null}")
        drains.append(NodeDrain(node, None if deadline is None else float(deadline)))
    return drains


def first_deadline(drains: Sequence[NodeDrain]) -> float | None:
    """The earliest of ``drains``' deadlines (None: none has one)."""
    return min((d.deadline for d in drains if d.deadline is not None), default=None)


class Draining:
    """The router's side of a drain: admission, in-flight requests, the deadline.

    At the deadline every request waiting for its engine's next output is cancelled
    (``Task.cancel``, as ``asyncio.timeout`` does, and told apart from any other
    cancellation the same way: ``uncancel``), which ends its sequence in the engine, and
    answered the deadline's error; one not waiting then gets it at its next output."""

    def __init__(self) -> None:
        self._drains: tuple[NodeDrain, ...] = ()
        self._timer: asyncio.TimerHandle | None = None
        self._expired: ApiError | None = None  # the deadline passed: what requests get
        self._waiting: set[asyncio.Task[Any]] = set()  # requests awaiting an output
        self._cut: set[asyncio.Task[Any]] = set()  # of which cancelled by the deadline
        self.in_flight = 0
        self.left = 0  # requests that ended, one way or another, while a drain was set
        self.ended = 0  # of which ended by a drain's deadline

    @property
    def active(self) -> bool:
        return bool(self._drains)

    def nodes(self) -> list[str]:
        return [d.node for d in self._drains]

    def set(self, drains: Sequence[NodeDrain]) -> None:
        """The drains now in force (all of them: replaces what was). Idempotent."""
        new = tuple(sorted(drains, key=lambda d: d.node))
        if new == self._drains:
            return
        if not new:
            log.info("drain ended: admitting requests again")
        else:
            log.info("draining: %s", ", ".join(
                f"{d.node} (deadline {'none' if d.deadline is None else time.ctime(d.deadline)})"
                for d in new))
        if not self._drains:
            self.left = self.ended = 0
        self._drains = new
        self._expired = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = first_deadline(new)
        if deadline is not None:
            first = next(d for d in new if d.deadline == deadline)
            delay = max(0.0, deadline - time.time())
            self._timer = asyncio.get_running_loop().call_later(delay, self._deadline,
                                                                first.node)

    def _deadline(self, node: str) -> None:
        self._timer = None
        log.warning("drain of %s reached its deadline: ending %d request(s) in flight", node,
                    self.in_flight)
        self._expired = ApiError(
            503, f"the request was ended: node {node} is draining and its drain reached its "
            "deadline before the request finished; retry once the node is undrained or "
            "serving moved", "server_error", code="drain_deadline",
            headers={"Retry-After": str(RETRY_AFTER_S)})
        for task in self._waiting - self._cut:
            self._cut.add(task)
            task.cancel()

    def check(self) -> None:
        """Raise 503 "draining" if a node this router needs is draining."""
        if not self._drains:
            return
        names = ", ".join(d.node for d in self._drains)
        node = "node" if len(self._drains) == 1 else "nodes"
        raise ApiError(
            503, f"{node} {names} draining: new requests are not admitted (requests "
            f"already running finish); retry in {RETRY_AFTER_S} s, or after `mlxctl undrain`",
            "server_error", code="draining", headers={"Retry-After": str(RETRY_AFTER_S)})

    @contextlib.asynccontextmanager
    async def track(self) -> AsyncIterator[None]:
        """One admitted request, counted in flight for its body."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self._drains:
                self.left += 1

    @property
    def finished(self) -> int:
        """Requests that left while a drain was set, not ended by its deadline: they
        completed (or their client went away)."""
        return self.left - self.ended

    async def next_output(self, outputs: AsyncIterator[T]) -> T:
        """``anext(outputs)``, unless a drain's deadline comes first: then the deadline's
        ApiError (the pending step is cancelled, which ends the engine's sequence)."""
        if self._expired is not None:
            self.ended += 1
            raise self._expired
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            return await anext(outputs)
        except asyncio.CancelledError:
            if task in self._cut and self._expired is not None:
                self._cut.discard(task)
                if task.uncancel() == 0:  # nobody else cancelled it: the deadline's end
                    self.ended += 1
                    raise self._expired from None
            raise
        finally:
            self._waiting.discard(task)
            self._cut.discard(task)
