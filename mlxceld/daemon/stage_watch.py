"""The daemon's watch over its pipeline stage worker, told each worker's transitions by
the supervisor (``Supervisor(finished=..., changed=...)``).

A worker that exits cleanly on its own stays down (the supervisor restarts failures
only; `mlxctl restart` starts it), except the stage of an active plan: sent SIGTERM
from outside, it drains and exits 0, and comes back after ``STAGE_BACK_S`` (1 s), since
the pipeline stalls without it and the roster still wants it. `mlxctl cluster
deactivate` (or a new plan without this host) and the daemon's own stop end a stage
for good.

A stage worker that failed (it could not load, and is not restarted) leaves its port to
a stand-in (``pipeline/standin.py``) that tells routers dialing it that the stage failed,
where and why, until the worker starts again or is removed; not while the daemon stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from mlxceld.cluster.clusterfile.placement import STAGE_WORKER
from mlxceld.daemon.roster import Roster
from mlxceld.pipeline.standin import StandIns
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.types import WorkerState
from mlxceld.wire import SecretStore

log = logging.getLogger(__name__)

STAGE_BACK_S: Final = 1.0  # a stage of the active plan that exited cleanly on its own
# restarts after this long


@dataclass(frozen=True)
class StageWatchParts:
    """What the stage watch uses, never the daemon: the supervisor (a stage's state and
    restart), the roster (whether the active plan wants the stage) and whether the daemon
    stops."""

    supervisor: Supervisor
    roster: Roster
    stopping: Callable[[], bool]

    def stage_wanted(self) -> bool:
        return not self.stopping() and self.roster.stage_wanted()


class StageWatch:
    """Told each worker's transitions by the supervisor (``finished``, ``changed``): it is
    made before the supervisor, and given its parts by ``watch`` once they exist."""

    def __init__(self, keyring: SecretStore, node_id: str) -> None:
        self._parts: StageWatchParts | None = None
        self._stand_ins = StandIns(keyring, node_id)

    def watch(self, parts: StageWatchParts) -> None:
        self._parts = parts

    def finished(self, name: str) -> None:
        """A worker exited cleanly on its own: the stage of an active plan comes back."""
        if name == STAGE_WORKER and self._parts is not None and self._parts.stage_wanted():
            log.info("worker %s exited cleanly, but it is a stage of the active plan: "
                     "starting it again in %g s", name, STAGE_BACK_S)
            asyncio.get_running_loop().call_later(STAGE_BACK_S, self._back)

    def changed(self, spec: WorkerSpec, state: WorkerState | None, reason: str) -> None:
        """A failed stage worker's port answers that it failed (``pipeline/standin.py``)."""
        if self._parts is not None and self._parts.stopping() and state is WorkerState.FAILED:
            return  # shutting down: no port is taken over now
        self._stand_ins.worker_changed(spec, state, reason)

    def _back(self) -> None:
        assert self._parts is not None, "told a stage's exit before its parts"
        supervisor = self._parts.supervisor
        now = supervisor.state(STAGE_WORKER)
        if now is not None and now[0] is WorkerState.EXITED and self._parts.stage_wanted():
            supervisor.restart(STAGE_WORKER)

    async def run(self) -> None:
        await self._stand_ins.run()

    def close(self) -> None:
        self._stand_ins.close()
