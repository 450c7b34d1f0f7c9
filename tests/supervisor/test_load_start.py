"""A model worker's start is bounded by its load's progress, not by its total: a real
router worker whose every layer takes 1.5 s to read (``MLXCELD_TEST_ROUTER_LAYER_S``)
loads for longer than its start timeout, and runs, because each advance the supervisor
hears (``Supervisor.note_loading``: its 2 s asks, ``LoadAdvanced``) counts the timeout
again. The same load with no progress reports would be killed (``states.py``; tested by
hand in test_states.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from mlxceld.failpoints import ROUTER_LAYER_ENV
from mlxceld.models import preset, write_fixture
from mlxceld.roles.options import RouterOptions
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.states import RestartPolicy
from mlxceld.types import WorkerState

from helpers.ports import free_port
from helpers.supervisor import running_supervisor

START_TIMEOUT_S = 6.0  # above a worker's imports on a busy machine; below the slowed load
LAYERS = 6  # 8 steps of 1.5 s: 12 s of load
DEADLINE_S = 90.0
ENDED = (WorkerState.RUNNING, WorkerState.BACKOFF, WorkerState.FAILED)  # killed: BACKOFF


async def start_router(state_dir: Path, model: Path
                       ) -> tuple[WorkerState, str, float, list[str]]:
    """Where the router's start ended (running, or killed: backoff), why, how long it
    took, and the loads the snapshot showed meanwhile."""
    options = RouterOptions(model=str(model), model_name="m", host="127.0.0.1",
                            port=free_port("127.0.0.1"), max_batch=1, max_queued=1)
    spec = WorkerSpec("router", state_dir, options,
                      policy=RestartPolicy(start_timeout_s=START_TIMEOUT_S, stop_timeout_s=20))
    seen: list[str] = []
    async with running_supervisor(state_dir) as (supervisor, _):
        begun = time.monotonic()
        await supervisor.reconcile([spec])
        async with asyncio.timeout(DEADLINE_S):
            while (supervisor.state("router") or (None,))[0] not in ENDED:
                for w in supervisor.snapshot():
                    if w.get("loading"):
                        seen.append(str(w["loading"]))
                await asyncio.sleep(0.2)
        took = time.monotonic() - begun
        state, reason = supervisor.state("router") or (WorkerState.EXITED, "gone")
    return state, reason, took, seen


def test_a_load_longer_than_the_start_timeout_runs_while_it_advances(
        state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_fixture(tmp_path / "m", preset("tiny", family="llama", layers=LAYERS))
    monkeypatch.setenv(ROUTER_LAYER_ENV, "1.5")
    state, reason, took, seen = asyncio.run(start_router(state_dir, model))
    assert state is WorkerState.RUNNING, reason  # never killed for its start timeout ...
    assert took > START_TIMEOUT_S + 3  # ... though it loaded well past it
    assert len(set(seen)) >= 3, seen  # the advances the supervisor heard
