"""A real ``Supervisor`` over a fresh ``state.db``, running for the length of a block."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from mlxceld.state import EventLog, WorkersTable, open_db
from mlxceld.supervisor.service import Supervisor


@contextlib.asynccontextmanager
async def running_supervisor(state_dir: Path) -> AsyncIterator[tuple[Supervisor, EventLog]]:
    """The supervisor (and its event log) of ``state_dir``, started; when the block ends
    (or fails), every worker still running is stopped (``reconcile([])``) and the
    supervisor closed, which ends its run."""
    db = open_db(state_dir / "state.db")
    events = EventLog(db)
    supervisor = Supervisor(WorkersTable(db), events, health_interval_s=5.0,
                            log_max_bytes=1 << 20, log_backups=1)
    async with asyncio.TaskGroup() as tg:
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        tg.create_task(supervisor.run(started))
        await started
        try:
            yield supervisor, events
        finally:
            try:
                await supervisor.reconcile([])
            finally:
                supervisor.close()
