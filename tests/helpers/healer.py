"""Self-healing's shell (``cluster/healer.py``) over the real planner, with fakes of our own
seams for what lies around it: a coordinator that records each heal's proposal and pushes
nothing, and discovery's poll (every host 32 GiB available, a stage port free)."""

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


class Coordinator:
    """Serves ``serving``; records each heal's proposal and pushes nothing."""

    def __init__(self, serving: Served | None) -> None:
        self.serving = serving
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


def heal_proposal(tmp_path: Path, coordinator: Coordinator, dead: set[str],
                  spares: tuple[str, ...]) -> Proposal:
    """The plan a heal of ``coordinator.serving`` proposes, ``dead`` of its hosts dead long
    past the grace, ``spares`` alive too."""
    served = coordinator.serving
    assert served is not None
    state = start_state(tmp_path / "state.db", reset=False)
    liveness: dict[str, tuple[LivenessState, float]] = {
        a: ("dead" if a in dead else "alive", 1.0) for a in (*served.peers, *spares)}
    healer = Healer(Healing(1.0), coordinator, Discovery(),  # type: ignore[arg-type]
                    liveness=lambda: liveness, candidates=lambda: list(spares),
                    events=state.events, keyring=keyring(b"k" * 32),
                    identity=served.peers[0], cluster="lab", tick_s=0.05)

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
    return coordinator.proposals[0]
