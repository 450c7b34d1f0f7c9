"""Admission: at most ``max_active`` sequences in the engine, ``max_queued`` more waiting.

Waiters are served first come, first served: a finishing sequence hands its
slot straight to the oldest waiter, so a newcomer never overtakes the queue.
Past ``max_queued`` waiters a request is refused at once with 503 and
``Retry-After``, rather than left to time out in a queue that cannot drain.
A waiter that goes away (client gone) leaves the queue; one cancelled just as
it was handed a slot hands the slot on.

``capacity`` (an engine whose ``max_batch`` changes: a router's pool of replicas found
by discovery, ``replicas/pool.py``'s ``add`` and ``retire``) is read at each request:
``max_active`` becomes it (at least 1: a pool with no member answers 503 itself), a
larger one handing the new slots to the waiters at once, a smaller one taking effect as
sequences end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from mlxceld.api.errors import ApiError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_active: int, max_queued: int, *,
                 capacity: Callable[[], int] | None = None) -> None:
        if capacity is not None:
            max_active = max(capacity(), 1)
        if max_active < 1 or max_queued < 0:
            raise ValueError(f"admission needs max_active >= 1 and max_queued >= 0, not "
                             f"{max_active} and {max_queued}")
        self.max_active = max_active
        self.max_queued = max_queued
        self.active = 0
        self._capacity = capacity
        self._waiters: deque[asyncio.Future[None]] = deque()

    def _follow(self) -> None:
        """``max_active`` as ``capacity`` says now; new slots go to the waiters."""
        if self._capacity is None:
            return
        self.max_active = max(self._capacity(), 1)
        while self.active < self.max_active and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self.active += 1

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the engine's slots for the body of the ``async with``.
        Raises ``ApiError`` 503 (code "overloaded") when the queue is full."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        self._follow()
        if self.active < self.max_active and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queued:
            log.warning("refused a request: %d sequences active and %d waiting",
                        self.active, len(self._waiters))
            raise ApiError(503, f"the server is busy ({self.active} sequences running, "
                           f"{len(self._waiters)} waiting); retry in {RETRY_AFTER_S} s",
                           "server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot while being cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def _release(self) -> None:
        if self.active > self.max_active:  # the capacity shrank: this slot goes
            self.active -= 1
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands; ``active`` stays
                return
        self.active -= 1
