"""A sequence whose stage is lost, held and replayed (``pipeline/replay.py``): stage services
and pipeline engines in one process over real MXCL on 127.0.0.x (``helpers/stages.py``),
behind a ``PipelineSwitch`` with a hold. A stage is killed mid-sequence (its listener
closed: every connection to it drops); a new plan's engine arrives (the switch), or the
stage comes back on its host; the client's stream goes on, no token repeated or lost, and
its greedy tokens are mlx-lm's for the whole run. Past the hold, the stage's loss is the
error, as without one."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from mlxceld.engine import EngineUnavailable, GenerationRequest, SamplingParams
from mlxceld.engine.base import TokenOutput
from mlxceld.engine.continuation import Continuity, remainder, replayable
from mlxceld.pipeline.engine import PipelineEngine
from mlxceld.pipeline.links import StageDraining, StageLost
from mlxceld.pipeline.replay import hold_for
from mlxceld.pipeline.switch import PipelineSwitch

from helpers.stages import cluster, reference

PROMPT = [1, 5, 9, 200, 31, 7, 64, 3]
SPLITS = [(0, 2), (2, 4)]
N = 160  # long enough that the stages are still decoding when one is killed
KILL_AFTER = 4  # tokens read by the client before the stage is killed
HOLD_S = 30.0  # generous: the tests end as soon as the new engine serves
FAILS_WITHIN_S = 10.0  # past a 1 s hold, the request fails by then (a loaded machine)


def greedy(n: int = N, **params: object) -> GenerationRequest:
    return GenerationRequest("r", PROMPT, SamplingParams(max_tokens=n, temperature=0.0,
                                                         **params))  # type: ignore[arg-type]


async def read(outputs: AsyncGenerator[TokenOutput, None], after: int,
               then: asyncio.Event) -> list[int]:
    """Every token of ``outputs``; ``then`` set once ``after`` were read."""
    got = []
    async for out in outputs:
        got.append(out.token)
        if len(got) == after:
            then.set()
    return got


def test_a_stage_killed_mid_sequence_is_replayed_on_the_new_plan(
        split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"
    want = reference(path, PROMPT, N)

    async def go() -> tuple[list[int], int, int, Continuity, Continuity]:
        async with cluster(path, SPLITS) as old, cluster(path, SPLITS) as new:
            first, second = old.engine(path), new.engine(path)
            switch = PipelineSwitch(first, hold_s=HOLD_S)
            killed = asyncio.Event()
            reading = asyncio.create_task(read(switch.generate(greedy()), KILL_AFTER, killed))
            await killed.wait()
            await old.stop_stage(1)  # the stage dies mid-sequence
            await asyncio.sleep(0.3)  # the sequence is held meanwhile
            holding = dataclasses.replace(switch.continuity)
            switch.switch(second)  # the heal's new plan
            got = await reading
            tokens = first.tokens, second.tokens
            await switch.aclose()
            return got, *tokens, holding, switch.continuity

    got, on_first, on_second, holding, after = asyncio.run(go())
    assert got == want  # one stream: nothing repeated, nothing lost, mlx-lm's tokens
    assert KILL_AFTER <= on_first < N and on_second == N - on_first, (on_first, on_second)
    # counted for /metrics: held while the stage was gone, then replayed
    assert holding == Continuity(held=1, held_total=1), holding
    assert after == Continuity(held_total=1, replayed_total=1), after


def test_a_sequence_outlasting_its_retired_engine_goes_on_on_the_current_one(
        split_fixture_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No hold (replica groups, a fixed plan): a live move's old engine is closed at
    ``RETIRE_S`` with a sequence still running on it; the sequence goes on on the current
    engine, one stream, mlx-lm's greedy tokens."""
    # closed well before the stages are done (the fixture decodes all N in ~0.3 s alone)
    monkeypatch.setattr("mlxceld.pipeline.switch.RETIRE_S", 0.05)
    path = split_fixture_dir / "llama"
    want = reference(path, PROMPT, N)

    async def go() -> tuple[list[int], int, int]:
        async with cluster(path, SPLITS) as old, cluster(path, SPLITS) as new:
            first, second = old.engine(path), new.engine(path)
            switch = PipelineSwitch(first)
            linked = asyncio.create_task(switch.keep_linked())
            moved = asyncio.Event()
            reading = asyncio.create_task(read(switch.generate(greedy()), KILL_AFTER, moved))
            await moved.wait()
            switch.switch(second)  # a live move; the old engine closes 0.05 s on
            got = await reading
            linked.cancel()
            await asyncio.gather(linked, return_exceptions=True)
            tokens = first.tokens, second.tokens
            await switch.aclose()
            return got, *tokens

    got, on_first, on_second = asyncio.run(go())
    assert got == want
    assert KILL_AFTER <= on_first < N and on_second == N - on_first, (on_first, on_second)


def test_a_stage_back_on_its_host_replays_on_the_same_engine(
        split_fixture_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No new plan: the stage's worker restarted on its host (a new listener on the same
    address): the engine's links attach again and the sequence is replayed there."""
    path = split_fixture_dir / "llama"
    want = reference(path, PROMPT, N)

    async def go() -> tuple[list[int], int]:
        async with cluster(path, SPLITS) as c:
            engine = c.engine(path, retry_s=(0.05, 0.2))
            switch = PipelineSwitch(engine, hold_s=HOLD_S)
            linked = asyncio.create_task(switch.keep_linked())
            killed = asyncio.Event()
            reading = asyncio.create_task(read(switch.generate(greedy()), KILL_AFTER, killed))
            await killed.wait()
            await c.stop_stage(1)
            await asyncio.sleep(0.3)
            await c.restart_stage(1)
            got = await reading
            linked.cancel()
            await asyncio.gather(linked, return_exceptions=True)
            await switch.aclose()
            return got, engine.tokens

    caplog.set_level(logging.INFO, "mlxceld.pipeline.replay")
    got, made = asyncio.run(go())
    assert got == want and made == N  # the tokens sent were prefilled again, not re-sent
    replays = [r.getMessage() for r in caplog.records if "replayed on" in r.getMessage()]
    assert len(replays) == 1 and "its stages back" in replays[0], replays


async def held_then_switched(switch: PipelineSwitch, second: PipelineEngine) -> list[int]:
    """A greedy request of 12 tokens on ``switch``: still held half a second later (not
    refused), then switched to ``second``; its tokens."""
    reading = asyncio.create_task(read(switch.generate(greedy(12)), 0, asyncio.Event()))
    await asyncio.sleep(0.5)
    assert not reading.done()  # held, not refused
    switch.switch(second)
    return await reading


def test_a_request_arriving_while_a_stage_is_gone_is_held_for_the_new_plan(
        split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"
    want = reference(path, PROMPT, 12)

    async def go() -> tuple[list[int], int]:
        async with cluster(path, SPLITS) as old, cluster(path, SPLITS) as new:
            first, second = old.engine(path, retry_s=(0.05, 0.2)), new.engine(path)
            switch = PipelineSwitch(first, hold_s=HOLD_S)
            linked = asyncio.create_task(switch.keep_linked())
            await first.connect()
            await old.stop_stage(1)
            got = await held_then_switched(switch, second)
            linked.cancel()
            await asyncio.gather(linked, return_exceptions=True)
            await switch.aclose()
            return got, second.tokens

    got, on_second = asyncio.run(go())
    assert got == want and on_second == 12


def test_a_request_a_stopping_stage_refuses_is_held_for_the_new_plan(
        split_fixture_dir: Path) -> None:
    """A stage draining (its worker told to stop: a re-plan stopping a tensor group before
    the new plan loads) refuses new sequences: held, then started on the new plan's engine;
    without a hold, the 503 naming the stage, at once."""
    path = split_fixture_dir / "llama"
    want = reference(path, PROMPT, 12)

    async def go() -> tuple[list[int], int, BaseException | None, Continuity]:
        async with cluster(path, SPLITS) as old, cluster(path, SPLITS) as new:
            first, second = old.engine(path), new.engine(path)
            await first.connect()
            draining = asyncio.create_task(old.services[1].finish_held(
                asyncio.get_running_loop().time() + 30))
            unheld: BaseException | None = None
            try:
                await read(PipelineSwitch(first).generate(greedy(12)), 0, asyncio.Event())
            except EngineUnavailable as exc:
                unheld = exc
            switch = PipelineSwitch(first, hold_s=HOLD_S)
            linked = asyncio.create_task(switch.keep_linked())
            got = await held_then_switched(switch, second)
            linked.cancel()
            await asyncio.gather(linked, draining, return_exceptions=True)
            await switch.aclose()
            return got, second.tokens, unheld, switch.continuity

    got, on_second, unheld, counts = asyncio.run(go())
    assert isinstance(unheld, StageDraining) and "stage-1 is draining" in str(unheld), unheld
    assert got == want and on_second == 12
    assert (counts.held_total, counts.replayed_total, counts.lost_total) == (1, 1, 0)


def test_past_the_hold_the_loss_is_the_error(split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"

    async def go() -> tuple[list[int], BaseException | None, float]:
        async with cluster(path, SPLITS) as c:
            switch = PipelineSwitch(c.engine(path), hold_s=1.0)
            got: list[int] = []
            error: BaseException | None = None
            began = 0.0
            try:
                async for out in switch.generate(greedy()):
                    got.append(out.token)
                    if len(got) == KILL_AFTER:
                        await c.stop_stage(1)
                        began = time.monotonic()
            except EngineUnavailable as exc:
                error = exc
            took = time.monotonic() - began
            await switch.aclose()
            return got, error, took

    got, error, took = asyncio.run(go())
    assert isinstance(error, StageLost) and "stage-1" in str(error), error
    assert KILL_AFTER <= len(got) < N
    assert 1.0 <= took < FAILS_WITHIN_S, took


def test_a_sequence_whose_sampling_keeps_generated_state_is_not_replayed(
        split_fixture_dir: Path) -> None:
    """A presence penalty counts the generated tokens on the last stage: a new stage could
    not count them, so the sequence fails at once, as without a hold."""
    path = split_fixture_dir / "llama"

    async def go() -> tuple[list[int], BaseException | None, float]:
        async with cluster(path, SPLITS) as c:
            switch = PipelineSwitch(c.engine(path), hold_s=HOLD_S)
            got: list[int] = []
            error: BaseException | None = None
            began = 0.0
            try:
                async for out in switch.generate(greedy(presence_penalty=0.5)):
                    got.append(out.token)
                    if len(got) == KILL_AFTER:
                        await c.stop_stage(1)
                        began = time.monotonic()
            except EngineUnavailable as exc:
                error = exc
            took = time.monotonic() - began
            await switch.aclose()
            return got, error, took

    got, error, took = asyncio.run(go())
    assert isinstance(error, StageLost), error
    assert KILL_AFTER <= len(got) < N
    assert took < FAILS_WITHIN_S / 2, took  # not held for HOLD_S


@pytest.mark.parametrize("params,sent,ok", [
    ({}, 5, True),
    ({"temperature": 0.7}, 5, True),  # unseeded: a draw from the same distribution
    ({"temperature": 0.7, "seed": 3}, 5, False),  # its random stream cannot be resumed
    ({"temperature": 0.0, "seed": 3}, 5, True),
    ({"presence_penalty": 0.5}, 5, False),
    ({"frequency_penalty": 0.5}, 5, False),
    ({"frequency_penalty": 0.5}, 0, True),  # nothing sent: a fresh start
    ({"repetition_penalty": 1.3}, 5, True),  # its window rides in the replayed prompt
])
def test_what_is_replayed(params: dict[str, float], sent: int, ok: bool) -> None:
    assert replayable(SamplingParams(max_tokens=8, **params), sent) is ok  # type: ignore[arg-type]


def test_the_remainder_prefills_what_was_sent() -> None:
    request = GenerationRequest("r", [1, 2], SamplingParams(max_tokens=10, min_tokens=4))
    again = remainder(request, [7, 8, 9])
    assert list(again.prompt_tokens) == [1, 2, 7, 8, 9]
    assert (again.params.max_tokens, again.params.min_tokens) == (7, 1)
    assert remainder(request, []) is request
    assert hold_for(10.0, 60.0) == 130.0 and hold_for(10.0, 0.0) == 0.0
