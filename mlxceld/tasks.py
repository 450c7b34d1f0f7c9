"""An owner's task group, whose tasks end when its owner is done (STYLE: one
``asyncio.TaskGroup`` per owner).

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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


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
