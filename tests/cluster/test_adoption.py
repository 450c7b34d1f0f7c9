"""A standby's takeover finds the plan's stage hosts among its candidates, alive
(cluster/adoption.py), and adopts the plan as the one its coordinator serves: a 2D mesh
with every rank's host, healed as a mesh."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.cluster.adoption import adopt, host_of, stage_hosts
from mlxceld.state.plans import Plans
from mlxceld.state.startup import start_state
from mlxceld.wire.agent_messages import Plan, PlanStage

from helpers.healer import Coordinator, heal_proposal

MODEL = "a" * 64
PLAN = Plan(7, "lab", MODEL, (PlanStage("stage-0", "10.0.0.2:19100", 0, (0, 8)),
                              PlanStage("stage-1", "10.0.0.3:19101", 1, (8, 16))))
CANDIDATES = ["10.0.0.2:19000", "10.0.0.3:19000", "10.0.0.4:19000"]


def test_each_stage_is_the_one_candidate_on_its_listeners_host() -> None:
    assert host_of("10.0.0.3:19101", CANDIDATES) == "10.0.0.3:19000"
    assert host_of("10.0.0.9:19101", CANDIDATES) is None
    assert host_of("10.0.0.3:19101", [*CANDIDATES, "10.0.0.3:19001"]) is None  # which one?
    assert stage_hosts(PLAN, lambda s: host_of(s, CANDIDATES), CANDIDATES) == (
        "10.0.0.2:19000", "10.0.0.3:19000")


@pytest.mark.parametrize("candidates,alive,said", [
    (CANDIDATES[1:], CANDIDATES, "the host of stage-0 (10.0.0.2:19100) is not one candidate"),
    (CANDIDATES, CANDIDATES[:1], "the host of stage-1 (10.0.0.3:19000) does not answer"),
])
def test_no_takeover_while_a_stage_host_is_unknown_or_silent(
        candidates: list[str], alive: list[str], said: str) -> None:
    why = stage_hosts(PLAN, lambda s: host_of(s, candidates), alive)
    assert isinstance(why, str) and why.startswith(said), why


# A 2D mesh of 2 x 2 as its coordinator answers `plan`: each stage's group, every rank's
# agent; a spare (.6) beside it.
MESH = Plan(9, "lab", MODEL, (
    PlanStage("stage-0", "10.0.0.2:19100", 0, (0, 8), ("10.0.0.2:19000", "10.0.0.3:19000")),
    PlanStage("stage-1", "10.0.0.4:19100", 1, (8, 16), ("10.0.0.4:19000", "10.0.0.5:19000"))))
MESH_HOSTS = ("10.0.0.2:19000", "10.0.0.3:19000", "10.0.0.4:19000", "10.0.0.5:19000")


def test_a_mesh_learnt_on_the_wire_keeps_every_ranks_host_as_a_stage_host() -> None:
    learnt = Plan.from_wire(MESH.to_wire())
    assert learnt == MESH and learnt.tp_size == 2
    candidates = [*MESH_HOSTS, "10.0.0.6:19000"]
    assert stage_hosts(learnt, lambda s: host_of(s, candidates), candidates) == MESH_HOSTS
    # a rank past 0 that does not answer holds the takeover back, as a stage host does
    why = stage_hosts(learnt, lambda s: host_of(s, candidates), MESH_HOSTS[:3])
    assert why == "the host of stage-1 rank 1 (10.0.0.5:19000) does not answer", why
    why = stage_hosts(learnt, lambda s: host_of(s, MESH_HOSTS[:3]), MESH_HOSTS)
    assert isinstance(why, str) and why.startswith(
        "the host of stage-1 rank 1 (10.0.0.5:19000) is not one candidate"), why


@pytest.mark.parametrize(("plan", "mode"), [
    (Plan(9, "lab", MODEL, (PlanStage("stage-0", "127.0.0.2:19100", 0, (0, 4),
                                      ("127.0.0.2:19000", "127.0.0.3:19000")),)), "auto"),
    (Plan(9, "lab", MODEL, (PlanStage("stage-0", "127.0.0.2:19100", 0, (0, 2)),
                            PlanStage("stage-1", "127.0.0.3:19100", 1, (2, 4)))), "pp"),
])
def test_an_adopted_mesh_is_healed_as_a_mesh_as_its_coordinator_would(
        tmp_path: Path, split_fixture_dir: Path, plan: Plan, mode: str) -> None:
    """The plan as the standby learns it (its wire form), adopted, one rank host dead and
    a spare alive: the heal plans a mesh of the hosts alive (``--mesh auto``), as the
    coordinator's own healer does; a pipeline is healed as a pipeline (``pp``)."""
    model = split_fixture_dir / "llama"
    learnt = Plan.from_wire(plan.to_wire())
    hosts = ("127.0.0.2:19000", "127.0.0.3:19000")
    peers = stage_hosts(learnt, lambda s: host_of(s, hosts), hosts)
    assert peers == hosts, peers
    coordinator = Coordinator(None)
    state = start_state(tmp_path / "adopted.db", reset=False)
    served = adopt(learnt, peers, str(model), coordinator=coordinator,  # type: ignore[arg-type]
                   plans=Plans(state.db), origin="127.0.0.1:19000")
    assert coordinator.serving == served and served.peers == hosts
    assert served.tp_size == learnt.tp_size == (2 if mode == "auto" else 1)
    row = Plans(state.db).get(9)
    assert row is not None and row.peers == hosts and row.decision == "active"
    proposal = heal_proposal(tmp_path, coordinator, {hosts[1]}, ("127.0.0.4:19000",))
    assert (proposal.mesh.mode if proposal.mesh else "pp") == mode, proposal.table
