"""Self-healing's shell (``cluster/healer.py``) over the real planner and a 4-layer tiny
checkpoint, with fakes of our own seams for what lies around it (the coordinator's push,
discovery's poll: ``helpers/healer.py``): a heal plans as many stages as the plan it
replaces had, or as many as there are hosts alive if fewer, as healer.py's docstring
says."""

from __future__ import annotations

from pathlib import Path

from mlxceld.cluster.coordinator import Served

from helpers.healer import Coordinator, heal_proposal

B, C, D, E = "127.0.0.2:19000", "127.0.0.3:19000", "127.0.0.4:19000", "127.0.0.5:19000"


def heal_once(tmp_path: Path, model: Path, peers: tuple[str, ...], dead: set[str],
              spares: tuple[str, ...]) -> int:
    """The stages of the plan a heal proposes: ``peers`` served, ``dead`` of them dead
    long past the grace, ``spares`` alive too."""
    coordinator = Coordinator(Served(7, str(model), peers))
    return len(heal_proposal(tmp_path, coordinator, dead, spares).plan.stages)


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
