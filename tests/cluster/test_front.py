"""The ``plan`` exchange (cluster/front.py) over a real agent listener on loopback: the
coordinator's router's pipeline as the answer, turned into the asker's own pipeline
option; no plan, an agent that does not answer it, and another secret, each said."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from mlxceld.cluster.coordinator import Served
from mlxceld.cluster.front import (
    ACTIVE_S,
    NO_PLAN,
    Fronts,
    PlanNotFound,
    ask_plan,
    pipeline_of,
    plan_of,
    serve_plan,
)
from mlxceld.net.agent import AgentService
from mlxceld.roles.options import PipelineOptions, PipelineStage
from mlxceld.wire.agent_messages import Plan

from helpers import keys
from helpers.mxcl import CLIENT_ID, OTHER_SECRET, SECRET, run, running

PIPE = PipelineOptions(
    stages=(PipelineStage("stage-0", "127.0.0.2:4000", 0, (0, 2)),
            PipelineStage("stage-1", "127.0.0.3:4001", 1, (2, 4))),
    coordinator="127.0.0.1:19000", model_identity="c" * 64, cluster="lab")
SERVED = Served(7, "/m", ("127.0.0.2:19000", "127.0.0.3:19000"))


async def asked(pipeline: PipelineOptions | None, *, serve: bool = True,
                secret: bytes = SECRET, fronts: Fronts | None = None,
                served: Served | None = SERVED) -> Plan:
    agent = AgentService(("127.0.0.1", 0), keys.keyring(SECRET))
    if serve:
        serve_plan(agent, lambda: plan_of(pipeline, served), fronts)
    async with running(agent):
        return await ask_plan(CLIENT_ID, agent.address, keyring=keys.keyring(secret))


def test_the_answer_is_the_routers_pipeline_and_the_asker_dials_as_itself() -> None:
    fronts = Fronts()
    plan = run(asked(PIPE, fronts=fronts))
    assert fronts.behind(float("inf"), time.monotonic()) == [CLIENT_ID]  # who asked
    assert plan.epoch == 7 and plan.model == "c" * 64
    assert pipeline_of(plan, "127.0.0.5:19000") == replace(PIPE, coordinator="127.0.0.5:19000")


def test_a_mesh_answers_each_stages_group_and_a_pipeline_none() -> None:
    """A 2D mesh of 2 x 2 (the plans table's peers: every rank's agent, stage by stage):
    each stage carries its group; the asker's pipeline is the same as without them."""
    mesh = ("127.0.0.2:19000", "127.0.0.4:19000", "127.0.0.3:19000", "127.0.0.5:19000")
    plan = run(asked(PIPE, served=Served(8, "/m", mesh, tp_size=2)))
    assert [s.tp_group for s in plan.stages] == [mesh[:2], mesh[2:]] and plan.tp_size == 2
    assert pipeline_of(plan, "127.0.0.5:19000") == replace(PIPE, coordinator="127.0.0.5:19000")
    assert run(asked(PIPE)).tp_size == 1
    assert all("tp_group" not in s for s in plan_of(PIPE, SERVED).to_wire()["stages"])
    # the router not yet on the served plan (a switch under way): no groups said this once
    assert plan_of(PIPE, Served(8, "/m", mesh[:2], tp_size=2)).tp_size == 1


def test_no_plan_is_an_empty_answer_and_no_pipeline() -> None:
    plan = run(asked(None))
    assert plan == NO_PLAN and pipeline_of(plan, "127.0.0.5:19000") is None


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"serve": False}, "plan"),  # an agent that does not serve the question
    ({"secret": OTHER_SECRET}, "coordinator"),
])
def test_each_failure_is_plan_not_found_naming_the_coordinator(kwargs: dict[str, object],
                                                               said: str) -> None:
    with pytest.raises(PlanNotFound) as err:
        run(asked(PIPE, **kwargs))  # type: ignore[arg-type]
    assert err.value.message.startswith("coordinator 127.0.0.1:") and said in err.value.message


def test_fronts_behind_are_those_active_lately_that_have_not_asked_since() -> None:
    fronts = Fronts()
    fronts.asked("a", 100.0)
    fronts.asked("b", 103.0)
    assert fronts.behind(since=102.0, now=104.0) == ["a"]  # b asked after the switch
    assert fronts.behind(since=105.0, now=105.0) == ["a", "b"]
    assert fronts.behind(since=200.0, now=100.0 + ACTIVE_S + 1) == ["b"]  # a went quiet
    fronts.asked("b", 120.0)  # a forgotten: not heard for ACTIVE_S
    assert fronts.behind(since=200.0, now=120.0) == ["b"]
