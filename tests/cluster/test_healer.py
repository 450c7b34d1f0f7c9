"""Self-healing's shell (``cluster/healer.py``) over the real planner and a 4-layer tiny
checkpoint, with fakes of our own seams for what lies around it (the coordinator's push,
discovery's poll): a heal plans as many stages as the plan it replaces had, or as many
as there are hosts alive if fewer, as healer.py's docstring says."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path

from mlxceld.cluster.coordinator import Served
from mlxceld.cluster.healer import Healer
from mlxceld.cluster.healing import Healing
from mlxceld.cluster.plan.candidates import Proposal
from mlxceld.state.liveness import LivenessState
from mlxceld.state.peers import PeerRow
from mlxceld.state.startup import start_state

from helpers.keys import keyring
from helpers.waiting import until

GIB = 1 << 30
B, C, D, E = "127.0.0.2:19000", "127.0.0.3:19000", "127.0.0.4:19000", "127.0.0.5:19000"


class Coordinator:
    """Serves a plan over ``peers``; records each heal's proposal and pushes nothing."""

    def __init__(self, model: Path, peers: tuple[str, ...]) -> None:
        self.serving: Served | None = Served(7, str(model), peers)
        self.busy = False
        self.proposals: list[Proposal] = []

    def kv_quant(self) -> None:
        return None

    def draft(self) -> tuple[str | None, int]:
        return None, 4

    async def heal(self, proposal: Proposal, old: Served, why: str, *,
                   live: bool = False) -> tuple[bool, str]:
        self.proposals.append(proposal)
        return False, "not pushed: a test"


class Discovery:
    """Every host polled answers: 32 GiB available, a stage port free."""

    async def refresh(self, only: Collection[str] | None = None) -> list[PeerRow]:
        return [PeerRow(address=a, source="static", state="reachable", updated_at=1.0,
                        node_id=f"n{a[8]}", memory_total=64 * GIB,
                        memory_available=32 * GIB, inventory={"ports": [19100], "model": None})
                for a in sorted(only or ())]


def heal_once(tmp_path: Path, model: Path, peers: tuple[str, ...], dead: set[str],
              spares: tuple[str, ...]) -> int:
    """The stages of the plan a heal proposes: ``peers`` served, ``dead`` of them dead
    long past the grace, ``spares`` alive too."""
    state = start_state(tmp_path / "state.db", reset=False)
    coordinator = Coordinator(model, peers)
    liveness: dict[str, tuple[LivenessState, float]] = {
        a: ("dead" if a in dead else "alive", 1.0) for a in (*peers, *spares)}
    healer = Healer(Healing(1.0), coordinator, Discovery(),  # type: ignore[arg-type]
                    liveness=lambda: liveness, candidates=lambda: list(spares),
                    events=state.events, keyring=keyring(b"k" * 32), identity=B,
                    cluster="lab", tick_s=0.05)

    async def go() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(healer.run())
            try:
                await until(lambda: coordinator.proposals or healer.state["state"]
                            == "refused", "a heal proposed", 30.0)
            finally:
                healer.close()

    asyncio.run(go())
    assert coordinator.proposals, healer.state
    return len(coordinator.proposals[0].plan.stages)


def test_a_heal_with_spares_alive_keeps_the_plans_stage_count(
        tmp_path: Path, split_fixture_dir: Path) -> None:
    """One host of two dead, two spares alive: three hosts to plan over, two stages."""
    model = split_fixture_dir / "llama"
    assert heal_once(tmp_path, model, (B, C), {B}, (D, E)) == 2


def test_a_heal_with_fewer_hosts_left_plans_fewer_stages(
        tmp_path: Path, split_fixture_dir: Path) -> None:
    """Two hosts of three dead, no spare: the one left takes the whole model."""
    model = split_fixture_dir / "llama"
    assert heal_once(tmp_path, model, (B, C, D), {B, C}, ()) == 1
