"""A coordinator's replica groups as pool members: a group is up only with every stage
attached, its error names it; the pool of groups reports each group's stages."""

from __future__ import annotations

import asyncio
import json

import pytest

from mlxceld.errors import ConfigError
from mlxceld.pipeline import PipelineEngine, StageAddress
from mlxceld.pipeline.switch import PipelineSwitch
from mlxceld.replicas.groups import GroupedPipelines, GroupMember
from mlxceld.roles import ROUTER
from mlxceld.roles.options import (
    PipelineOptions,
    PipelineStage,
    RouterOptions,
    options_json,
    parse_options,
)

from helpers.keys import keyring
from helpers.ports import free_port


def group(index: int, port: int) -> GroupMember:
    """A one-stage group whose stage nobody listens for (a closed loopback port)."""
    stage = StageAddress(f"stage-{index}", "127.0.0.1", port, 0, (0, 2))
    engine = PipelineEngine([stage], keyring=keyring(b"s" * 32), origin="127.0.0.1:0",
                            model_identity="sha256:x", cluster="c", model_id="m",
                            context_length=64, eos_token_ids={0}, max_batch=3,
                            retry_s=(0.05, 0.2), dial_budget_s=0.2)
    return GroupMember(index, PipelineSwitch(engine), f"127.0.0.1:{port}")


def test_groups_down_until_every_stage_attaches() -> None:
    asyncio.run(groups_down())


async def groups_down() -> None:
    members = [group(0, free_port("127.0.0.1")), group(1, free_port("127.0.0.1"))]
    pool = GroupedPipelines(members, model_id="m", context_length=64)
    assert pool.max_batch == 6 and [m.node_id for m in members] == ["replica-0", "replica-1"]
    assert members[0].state() == "connecting"  # never dialed yet
    linking = asyncio.create_task(pool.keep_linked())
    try:
        async with asyncio.timeout(30):  # both groups down: their stage refuses the dial
            while not all(m.state() == "down" for m in members):
                await asyncio.sleep(0.05)
        error = members[1].last_error() or ""
        assert error.startswith("replica-1: 1 of 1 stages not attached"), error
        ready = pool.readiness()
        assert ready is not None and "replica-0" in ready["message"]
        stages = pool.stages()
        assert [(s["stage"], s["replica"]) for s in stages] == [("stage-0", 0), ("stage-1", 1)]
        shown = pool.stats(verbose=False)
        assert [(n["id"], n["role"], n["state"]) for n in shown["nodes"]] == [
            ("replica-0", "pipeline", "down"), ("replica-1", "pipeline", "down")]
        assert pool.tokens == 0
    finally:
        linking.cancel()
        await asyncio.gather(linking, return_exceptions=True)
        await pool.aclose()


def test_router_options_carry_the_groups_over_the_bootstrap_pipe() -> None:
    pipes = [PipelineOptions((PipelineStage(f"stage-{i}", f"127.0.0.{2 + i}:19100", 0,
                                            (0, 2)),), "127.0.0.1:19000", "sha256:x", "c")
             for i in range(3)]
    options = RouterOptions("m", "m", "127.0.0.1", 8080, 4, 16, pipeline=pipes[0],
                            replica_pipelines=tuple(pipes[1:]))
    again = parse_options(ROUTER, json.loads(json.dumps(options_json(options))), "options")
    assert again == options
    with pytest.raises(ConfigError, match="replica_pipelines"):
        parse_options(ROUTER, {**options_json(options), "pipeline": None}, "options")


def engine(index: int, port: int) -> PipelineEngine:
    stage = StageAddress(f"stage-{index}", "127.0.0.1", port, 0, (0, 2))
    return PipelineEngine([stage], keyring=keyring(b"s" * 32), origin="127.0.0.1:0",
                          model_identity="sha256:x", cluster="c", model_id="m",
                          context_length=64, eos_token_ids={0}, max_batch=3,
                          retry_s=(0.05, 0.2), dial_budget_s=0.2)


def test_a_move_switches_the_groups_kept_retires_those_dropped_and_adds_new_ones() -> None:
    asyncio.run(moved())


async def moved() -> None:
    members = [group(0, free_port("127.0.0.1")), group(1, free_port("127.0.0.1"))]
    pool = GroupedPipelines(members, model_id="m", context_length=64)
    first = members[0].engine.current
    try:
        assert pool.retiring() == 0 and members[0].state() == "connecting"
        # A heal's plan of one group: replica-0 on new stages, replica-1 dropped.
        port = free_port("127.0.0.1")
        pool.move([(engine(2, port), f"127.0.0.1:{port}")], hold_s=5.0)
        assert pool.groups == (members[0],) and members[0].engine.current is not first
        assert members[0].engine.hold_s == 5.0  # one group left: healed with replays
        assert members[0].address == f"127.0.0.1:{port}"
        # Its new stages serve (their plan is active): a first dial does not keep it out.
        assert members[0].state() == "up"
        assert [m.node_id for m in pool.members()] == ["replica-0"] and pool.max_batch == 3
        assert pool.retiring() == 1  # replica-0's old engine, not closed yet
        assert [(s["stage"], s["replica"]) for s in pool.stages()] == [("stage-2", 0)]
        # A later plan of two groups again: replica-1 joins, moved from the start.
        port = free_port("127.0.0.1")
        pool.move([(engine(3, free_port("127.0.0.1")), "127.0.0.1:1"),
                   (engine(4, port), f"127.0.0.1:{port}")])
        assert [m.node_id for m in pool.members()] == ["replica-0", "replica-1"]
        assert pool.max_batch == 6 and pool.groups[1].state() == "up"
        assert pool.retiring() == 2  # replica-0's two engines before
    finally:
        await pool.aclose()
