"""A model worker's start is bounded by its load's progress, not by its total: a real
router worker whose every layer takes 1.5 s to read (``MLXCELD_TEST_ROUTER_LAYER_S``)
loads for longer than its start timeout, and runs, because each advance the supervisor
hears (``Supervisor.note_loading``: its 2 s asks, ``LoadAdvanced``) counts the timeout
again. The same load with no progress reports would be killed (``states.py``; tested by
hand in test_states.py).

A router or stage worker told to stop while it loads (an assignment aborted while its
stage prepared, the daemon stopping) exits at once, cleanly, its load left unfinished
(``runtime.unless_stopped``), instead of finishing a load that may take minutes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from mlxceld.failpoints import ROUTER_LAYER_ENV, STAGE_LAYER_ENV
from mlxceld.models import preset, write_fixture
from mlxceld.models.identity import model_identity
from mlxceld.roles.options import RouterOptions, StageOptions, WorkerOptions
from mlxceld.supervisor.exits import read_exit_record
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.states import RestartPolicy
from mlxceld.types import WorkerState

from helpers.ports import free_port
from helpers.supervisor import running_supervisor

# Above a worker's imports on a busy machine (6 s was not, beside parallel tests: killed
# before its first progress report); below the slowed load.
START_TIMEOUT_S = 10.0
LAYERS = 10  # 12 steps of 1.5 s: 18 s of load
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
                    if w.loading:
                        seen.append(str(w.loading))
                await asyncio.sleep(0.2)
        took = time.monotonic() - begun
        state, reason = supervisor.state("router") or (WorkerState.EXITED, "gone")
    return state, reason, took, seen


@pytest.mark.slow
def test_a_load_longer_than_the_start_timeout_runs_while_it_advances(
        state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_fixture(tmp_path / "m", preset("tiny", family="llama", layers=LAYERS))
    monkeypatch.setenv(ROUTER_LAYER_ENV, "1.5")
    state, reason, took, seen = asyncio.run(start_router(state_dir, model))
    assert state is WorkerState.RUNNING, reason  # never killed for its start timeout ...
    assert took > START_TIMEOUT_S + 3  # ... though it loaded well past it
    assert len(set(seen)) >= 3, seen  # the advances the supervisor heard


async def stop_while_loading(state_dir: Path, spec: WorkerSpec) -> int:
    """Start ``spec`` and stop it (removed from the config) once it says it loads; its pid."""
    async with running_supervisor(state_dir) as (supervisor, _):
        await supervisor.reconcile([spec])
        async with asyncio.timeout(DEADLINE_S):
            while not (w := next((v.to_json() for v in supervisor.snapshot()), {})).get("loading"):
                assert w.get("state") not in ("running", "backoff", "failed"), (
                    w, spec.log_path.read_text(errors="replace")[-3000:])
                await asyncio.sleep(0.1)
        await supervisor.reconcile([])
    return int(w["pid"])


@pytest.mark.parametrize("role", ["router", "stage"])
def test_a_worker_stopped_while_it_loads_exits_at_once_and_cleanly(
        role: str, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_fixture(tmp_path / "m", preset("tiny", family="llama", layers=LAYERS))
    monkeypatch.setenv(ROUTER_LAYER_ENV if role == "router" else STAGE_LAYER_ENV, "1.5")
    options: WorkerOptions
    if role == "router":
        options = RouterOptions(model=str(model), model_name="m", host="127.0.0.1",
                                port=free_port("127.0.0.1"), max_batch=1, max_queued=1)
    else:
        options = StageOptions(
            model=str(model), layers=(0, LAYERS), node_id="stage-0", rank=0,
            address=f"127.0.0.1:{free_port('127.0.0.1')}", coordinator="127.0.0.1:1",
            upstream=None, downstream=None, first=None, last=None,
            model_identity=model_identity(model), cluster="test", silence_s=2.0)
    spec = WorkerSpec(role, state_dir, options, secret=b"load-stop-test-secret-0123456789",
                      policy=RestartPolicy(start_timeout_s=60, stop_timeout_s=60))
    pid = asyncio.run(stop_while_loading(state_dir, spec))
    cause = read_exit_record(spec.exit_record, pid)
    log = spec.log_path.read_text(errors="replace")
    assert cause is not None and cause.kind == "clean", (cause, log[-2000:])
    assert f"worker {role} told to stop during its load: it exits without finishing it" \
        in log, log[-2000:]
    assert f"worker {role} is ready" not in log, log[-2000:]
