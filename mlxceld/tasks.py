"""An owner's tasks end when its owner is done (STYLE: one ``asyncio.TaskGroup`` per
owner, no orphan ``create_task``).

``asyncio.TaskGroup`` waits for its tasks when its body ends, and cancels them
only when the body or one of them raises; Python 3.11 has no ``TaskGroup.cancel``.
A service that owns tasks for as long as it runs (a listener's connections, a
supervisor's runners) wants the other ending: once its body is done (told to
close), every task still running is cancelled and waited for.
``cancelling_group`` is that task group:

    async with cancelling_group() as tg:
        self._tg = tg                 # tasks are made here, and from callbacks
        await self._closing.wait()
    # every task of tg has ended

It ends the group by raising a private exception at the end of the body, and
swallows only that one. A task's exception still ends the group at once and
propagates, as from any ``TaskGroup`` (in an ``ExceptionGroup``), and so does a
cancellation from outside.

``scoped_group`` is the same group for a scope whose caller tells exceptions apart (a
listener catches a handler's ``ConnectionClosed``; a round catches its own errors): the
one exception that ends it comes out as itself, not in an ``ExceptionGroup``. A
connection's heartbeat beside its read loop is its use:

    async with scoped_group() as tg:
        tg.create_task(watch(stream, silence_s, what))
        while True:
            handle(await stream.recv())     # ConnectionClosed comes out as itself

``Background`` holds the tasks of an owner that has no scope to hold a task group in:
an object whose methods run in other tasks (an engine's requests, a link's reader
callbacks) and whose end is its ``aclose``. It keeps each task while it runs, logs a
failure with the owner's name (never lost), and its ``aclose`` ends those still running
and waits for them, so none outlives its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class _BodyDone(Exception):
    """Raised where the body of a ``cancelling_group`` ends: the group cancels the rest."""


@contextlib.asynccontextmanager
async def cancelling_group() -> AsyncIterator[asyncio.TaskGroup]:
    """A ``TaskGroup`` whose tasks still running when the body ends are cancelled."""
    try:
        async with asyncio.TaskGroup() as tg:
            yield tg
            raise _BodyDone
    except* _BodyDone:
        pass


@contextlib.asynccontextmanager
async def scoped_group() -> AsyncIterator[asyncio.TaskGroup]:
    """A ``cancelling_group`` whose one exception (the body's, or a task's) is raised as
    itself; several at once stay an ``ExceptionGroup``."""
    try:
        async with cancelling_group() as tg:
            yield tg
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        only = group.exceptions[0]
    else:
        return
    raise only  # out of the except clause: its cause and context stay its own


class Background:
    """The tasks of ``owner`` (its name, for the log), until its ``aclose``."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` in a task of the owner's."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s: a task of its own failed", self._owner, exc_info=exc)

    async def aclose(self, *, within_s: float | None = 0.0) -> None:
        """End every task still running: each may finish for ``within_s`` (None: as long
        as it takes), then those left are cancelled; returns once all have ended."""
        tasks = list(self._tasks)
        if not tasks:
            return
        if within_s is None or within_s > 0:
            await asyncio.wait(tasks, timeout=within_s)
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
