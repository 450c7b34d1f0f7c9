"""A peer's ``LocalStageHost`` over a real supervisor and a real stage worker process: a
stage that fails at once makes ``prepare_stage`` raise at once, naming the worker's state
and why, whether the failure is final (FAILED) or to be retried (BACKOFF); a load that
goes on (each layer slowed down: ``MLXCELD_TEST_STAGE_LAYER_S``) is waited for however long
it takes, one that stops advancing fails. The daemon's side is our own seam: the roster of
the placement, as the daemon draws it."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxceld.cluster.assignment import stagehost
from mlxceld.cluster.assignment.peer import PREPARE_S
from mlxceld.cluster.assignment.stagehost import LocalStageHost, RankAssignment
from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.config.daemon import Config
from mlxceld.config.serve import ServeConfig
from mlxceld.daemon.roster import Situation, draw_roster
from mlxceld.errors import DaemonError
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.service import Supervisor
from mlxceld.supervisor.states import RestartPolicy
from mlxceld.types import JSON

from helpers.ports import free_port
from helpers.supervisor import running_supervisor

PROMPT_S = 20.0  # a worker's start (imports) and its first exit; PREPARE_S is 60 s


@dataclass
class RosterSlot:
    """``StageSlot`` as the daemon is one: its placement and standby, drawn as a roster."""

    supervisor: Supervisor
    config: Config
    secret: bytes
    placement: Placement | None = None
    standby: bool = False
    retiring: WorkerSpec | None = None

    def accept_rank(self, rank: RankAssignment | None) -> None:
        assert rank is None  # these plans are pipelines: no rank of a tensor group here

    def set_stage(self, placement: Placement | None, *, standby: bool) -> None:
        self.placement, self.standby = placement, standby

    def keep_retiring(self, spec: WorkerSpec | None) -> None:
        self.retiring = spec

    def grouped(self) -> bool:
        return False  # ServeConfig(): tp_size 1

    async def reconcile(self) -> None:
        await self.supervisor.reconcile(draw_roster(Situation(
            self.config, ServeConfig(), self.placement, standby=self.standby,
            secret=self.secret)) + ([self.retiring] if self.retiring else []))


def cluster_toml(port: int) -> str:
    return f"""
[cluster]
name = "c1"
pipeline_parallel_size = 1

[[nodes]]
id = "coordinator"
address = "127.0.0.1:19000"
role = "coordinator"

[[nodes]]
id = "stage-0"
address = "127.0.0.1:{port}"
role = "pipeline_stage"
rank = 0
layers = [0, 2]
"""


async def prepare_on_a_taken_port(state_dir: Path, model: Path, policy: RestartPolicy
                                  ) -> tuple[float, str]:
    """``prepare_stage`` of a stage whose port another listener holds: the worker fails as
    it starts. Returns how long prepare took and what it raised."""
    config = Config(state_dir=state_dir, socket=state_dir / "ctl.sock", policy=policy,
                    pp_peer=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with running_supervisor(state_dir) as (supervisor, events):
            slot = RosterSlot(supervisor, config, secrets.token_bytes(32))
            host = LocalStageHost(slot, supervisor, events, cluster="c1", state_dir=state_dir,
                                  model=lambda: str(model), agent_host=lambda: "127.0.0.1")
            begun = time.monotonic()
            try:
                async with asyncio.timeout(PROMPT_S):  # not PREPARE_S: "at once"
                    with pytest.raises(DaemonError) as info:
                        await host.prepare_stage(1, "stage-0", cluster_toml(port))
                took = time.monotonic() - begun
            finally:
                await host.stop_stage()
    assert slot.placement is None and supervisor.names() == []
    assert info.value.hint == "see: mlxctl logs stage"
    return took, info.value.message


@pytest.mark.parametrize(("policy", "state"), [
    (RestartPolicy(flap_max_exits=1), "failed"),  # the first failed exit is final
    (RestartPolicy(), "backoff"),  # the first of five: a restart is due
])
def test_a_stage_that_fails_at_once_is_reported_at_once(state_dir: Path, fixture_dir: Path,
                                                        policy: RestartPolicy,
                                                        state: str) -> None:
    took, message = asyncio.run(prepare_on_a_taken_port(state_dir, fixture_dir / "llama",
                                                        policy))
    assert took < PROMPT_S < PREPARE_S
    assert message.startswith(f"stage worker is {state}: ")
    assert "cannot listen on 127.0.0.1:" in message and "for stage stage-0" in message


async def prepare_with_a_slow_disk(state_dir: Path, model: Path
                                   ) -> tuple[float, DaemonError | None, list[JSON]]:
    """``prepare_stage`` of a stage whose every layer takes ``MLXCELD_TEST_STAGE_LAYER_S``
    to load. Returns how long prepare took, what it raised, and each ``loading`` the
    supervisor's snapshot showed meanwhile (what systemd's STATUS line is made of)."""
    config = Config(state_dir=state_dir, socket=state_dir / "ctl.sock", pp_peer=True)
    seen: list[JSON] = []
    error: DaemonError | None = None
    async with running_supervisor(state_dir) as (supervisor, events):
        slot = RosterSlot(supervisor, config, secrets.token_bytes(32))
        host = LocalStageHost(slot, supervisor, events, cluster="c1", state_dir=state_dir,
                              model=lambda: str(model), agent_host=lambda: "127.0.0.1")

        async def watch() -> None:
            while True:
                seen.extend(w.loading for w in supervisor.snapshot() if w.loading is not None)
                await asyncio.sleep(0.1)

        watching = asyncio.create_task(watch())
        begun = time.monotonic()
        try:
            async with asyncio.timeout(PROMPT_S * 2):
                await host.prepare_stage(1, "stage-0", cluster_toml(free_port("127.0.0.1")))
        except DaemonError as exc:
            error = exc
        took = time.monotonic() - begun
        watching.cancel()
        await host.stop_stage()
    return took, error, seen


@pytest.fixture
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stagehost, "PROGRESS_EVERY_S", 0.1)
    monkeypatch.setattr(stagehost, "LOAD_STALL_S", 1.5)


@pytest.mark.usefixtures("fast_polls")
def test_a_load_that_advances_is_waited_for_past_the_stall_bound(
        state_dir: Path, fixture_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is on no progress, not on the whole load: each layer takes 0.6 s (three
    steps), the whole prepare longer than LOAD_STALL_S (1.5 s here), and it succeeds."""
    monkeypatch.setenv("MLXCELD_TEST_STAGE_LAYER_S", "0.6")
    took, error, seen = asyncio.run(prepare_with_a_slow_disk(state_dir, fixture_dir / "llama"))
    assert error is None
    assert took > 3 * 0.6 > stagehost.LOAD_STALL_S
    done = [p["done"] for p in seen]
    assert done == sorted(done) and len(set(done)) >= 2, seen
    assert all(p["total"] == seen[0]["total"] > 0 for p in seen)


@pytest.mark.usefixtures("fast_polls")
def test_a_load_that_stalls_fails_naming_where(state_dir: Path, fixture_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stagehost, "LOAD_STALL_S", 0.6)
    monkeypatch.setenv("MLXCELD_TEST_STAGE_LAYER_S", "1.5")
    _, error, _ = asyncio.run(prepare_with_a_slow_disk(state_dir, fixture_dir / "llama"))
    assert error is not None
    assert error.message == "stage worker's load made no progress for 0.6 s (at 0 bytes)"
    assert "mlxctl logs stage" in error.hint


async def replace_a_serving_stage(state_dir: Path, model: Path) -> dict[str, object]:
    """Plan 1's stage serves; plan 2's is prepared (plan 1's kept serving as
    ``stage-retiring``, the same process), then stopped before it served (plan 1's is
    ``stage`` again); plan 3's is prepared and activated, and plan 1 said to be over
    (``end_epoch``): the kept stage stops. What was seen at each step."""
    config = Config(state_dir=state_dir, socket=state_dir / "ctl.sock", pp_peer=True)
    seen: dict[str, object] = {}
    async with running_supervisor(state_dir) as (supervisor, events):
        slot = RosterSlot(supervisor, config, secrets.token_bytes(32))
        host = LocalStageHost(slot, supervisor, events, cluster="c1", state_dir=state_dir,
                              model=lambda: str(model), agent_host=lambda: "127.0.0.1")

        def pids() -> dict[str, int | None]:
            return {w.name: w.pid for w in supervisor.snapshot()}

        async with asyncio.timeout(PROMPT_S * 4):
            await host.prepare_stage(1, "stage-0", cluster_toml(free_port("127.0.0.1")))
            await host.activate_stage()
            first = pids()["stage"]
            await host.prepare_stage(2, "stage-0", cluster_toml(free_port("127.0.0.1")))
            seen["loaded beside"] = pids()
            await host.stop_stage()  # aborted before it served
            seen["set back"] = pids()
            await host.prepare_stage(3, "stage-0", cluster_toml(free_port("127.0.0.1")))
            await host.activate_stage()
            seen["before the end"] = pids()
            seen["said"] = await host.end_epoch(1)
            seen["after the end"] = pids()
            seen["first"] = first
        await host.stop_stage()
        seen["events"] = [e.kind for e in events.since(0, 500) if e.kind.startswith("stage.")]
    return seen


def test_a_serving_stage_serves_on_beside_its_successor_until_its_plan_is_over(
        state_dir: Path, fixture_dir: Path) -> None:
    seen = asyncio.run(replace_a_serving_stage(state_dir, fixture_dir / "llama"))
    first = seen["first"]
    beside = seen["loaded beside"]
    assert isinstance(beside, dict) and beside["stage-retiring"] == first, seen
    assert beside["stage"] not in (None, first), seen
    assert seen["set back"] == {"stage": first}, seen
    before = seen["before the end"]
    assert isinstance(before, dict) and before["stage-retiring"] == first, seen
    assert seen["said"] == "its stage, kept serving while the next plan came up, is stopped"
    after = seen["after the end"]
    assert isinstance(after, dict) and set(after) == {"stage"} and after["stage"] != first
    assert seen["events"] == ["stage.active", "stage.retiring", "stage.kept", "stage.retiring",
                              "stage.active", "stage.retired"], seen
