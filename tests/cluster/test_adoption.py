"""A standby's takeover finds the plan's stage hosts among its candidates, alive
(cluster/adoption.py), and adopts the plan as the one its coordinator serves."""

from __future__ import annotations

import pytest

from mlxceld.cluster.adoption import host_of, stage_hosts
from mlxceld.wire.agent_messages import Plan, PlanStage

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
