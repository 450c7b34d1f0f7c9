"""The ``plan`` exchange (cluster/front.py) over a real agent listener on loopback: the
coordinator's router's pipeline as the answer, turned into the asker's own pipeline
option; no plan, an agent that does not answer it, and another secret, each said."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

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

from helpers import keys
from helpers.mxcl import CLIENT_ID, OTHER_SECRET, SECRET, run, running

PIPE = PipelineOptions(
    stages=(PipelineStage("stage-0", "127.0.0.2:4000", 0, (0, 2)),
            PipelineStage("stage-1", "127.0.0.3:4001", 1, (2, 4))),
    coordinator="127.0.0.1:19000", model_identity="c" * 64, cluster="lab")


async def asked(pipeline: PipelineOptions | None, *, serve: bool = True,
                secret: bytes = SECRET, fronts: Fronts | None = None) -> object:
    agent = AgentService(("127.0.0.1", 0), keys.keyring(SECRET))
    if serve:
        serve_plan(agent, lambda: plan_of(pipeline, 7 if pipeline else None), fronts)
    async with running(agent):
        return await ask_plan(CLIENT_ID, agent.address, keyring=keys.keyring(secret))


def test_the_answer_is_the_routers_pipeline_and_the_asker_dials_as_itself() -> None:
    fronts = Fronts()
    plan = run(asked(PIPE, fronts=fronts))
    assert fronts.behind(float("inf"), time.monotonic()) == [CLIENT_ID]  # who asked
    assert plan.epoch == 7 and plan.model == "c" * 64
    assert pipeline_of(plan, "127.0.0.5:19000") == replace(PIPE, coordinator="127.0.0.5:19000")


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
