"""Admission: at most ``max_active`` sequences in the engine, ``max_queued`` more waiting.

Waiters are served first come, first served: a finishing sequence hands its
slot straight to the oldest waiter, so a newcomer never overtakes the queue.
Past ``max_queued`` waiters a request is refused at once with 503 and
``Retry-After``, rather than left to time out in a queue that cannot drain.
A waiter that goes away (client gone) leaves the queue; one cancelled just as
it was handed a slot hands the slot on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator

from mlxceld.api.errors import ApiError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_active: int, max_queued: int) -> None:
        if max_active < 1 or max_queued < 0:
            raise ValueError(f"admission needs max_active >= 1 and max_queued >= 0, not "
                             f"{max_active} and {max_queued}")
        self.max_active = max_active
        self.max_queued = max_queued
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

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
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands; ``active`` stays
                return
        self.active -= 1
