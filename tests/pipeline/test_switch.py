"""``PipelineSwitch`` (``pipeline/switch.py``): after a switch new sequences go to the new
engine, a sequence begun on the old one ends there, and the old engine is closed once it
has none left (or after ``RETIRE_S``). Fake engines of our own seam, no sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from mlxceld.engine.base import GenerationRequest, SamplingParams, TokenOutput
from mlxceld.pipeline import switch as switch_module
from mlxceld.pipeline.switch import PipelineSwitch


class FakeEngine:
    """Yields one token per ``step.set()``; ``closed`` once ``aclose`` ran."""

    model_id, context_length, max_batch = "m", 64, 4

    def __init__(self, name: str) -> None:
        self.name = name
        self.running = 0
        self.linked = 0
        self.closed = False
        self.step = asyncio.Event()
        self.tokens = 0
        self.rekeyed = 0

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        self.running += 1
        try:
            for i in range(request.params.max_tokens):
                await self.step.wait()
                self.step.clear()
                last = i == request.params.max_tokens - 1
                self.tokens += 1
                yield TokenOutput(i, "length" if last else None)
        finally:
            self.running -= 1

    def active_sequences(self) -> int:
        return self.running

    def readiness(self) -> dict[str, Any] | None:
        return {"engine": self.name}

    def stages(self) -> list[dict[str, Any]]:
        return [{"engine": self.name}]

    async def keep_linked(self) -> None:
        self.linked += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.linked -= 1

    async def aclose(self) -> None:
        self.closed = True

    def rekey(self) -> None:
        self.rekeyed += 1


def request(n: int) -> GenerationRequest:
    return GenerationRequest("r", [1, 2], SamplingParams(max_tokens=n))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_running_sequences_end_on_the_old_engine_new_ones_go_to_the_new() -> None:
    asyncio.run(switched())


async def switched() -> None:
    old, new = FakeEngine("old"), FakeEngine("new")
    sw = PipelineSwitch(old)  # type: ignore[arg-type]
    linking = asyncio.create_task(sw.keep_linked())
    await settle()
    first = sw.generate(request(2))
    old.step.set()
    assert (await anext(first)).token == 0
    sw.switch(new)  # type: ignore[arg-type]
    await settle()
    assert (old.linked, new.linked) == (1, 1)  # the old links stay up for its sequence
    assert sw.readiness() == {"engine": "new"} and sw.stages() == [{"engine": "new"}]
    second = sw.generate(request(1))
    new.step.set()
    assert await anext(second) == TokenOutput(0, "length")
    assert sw.active_sequences() == 2 and not old.closed
    old.step.set()
    assert await anext(first) == TokenOutput(1, "length")
    await first.aclose()
    await second.aclose()
    for _ in range(50):  # retired at its next look (POLL_S)
        if old.closed and not old.linked:
            break
        await asyncio.sleep(0.02)
    assert old.closed and old.linked == 0 and not new.closed
    assert sw.active_sequences() == 0
    linking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await linking
    await sw.aclose()
    assert new.closed


def test_an_old_engine_is_closed_after_retire_s_at_most(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(switch_module, "RETIRE_S", 0.2)
    asyncio.run(retired())


async def retired() -> None:
    old, new = FakeEngine("old"), FakeEngine("new")
    sw = PipelineSwitch(old)  # type: ignore[arg-type]
    linking = asyncio.create_task(sw.keep_linked())
    stuck = sw.generate(request(5))
    old.step.set()
    await anext(stuck)
    sw.switch(new)  # type: ignore[arg-type]
    await asyncio.sleep(0.5)
    assert old.closed and old.active_sequences() == 1  # closed with its sequence still on
    await stuck.aclose()
    linking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await linking


def test_tokens_never_go_back_and_a_rekey_reaches_every_engine() -> None:
    asyncio.run(counted())


async def counted() -> None:
    old, new = FakeEngine("old"), FakeEngine("new")
    sw = PipelineSwitch(old)  # type: ignore[arg-type]
    linking = asyncio.create_task(sw.keep_linked())
    first = sw.generate(request(2))
    old.step.set()
    await anext(first)
    sw.switch(new)  # type: ignore[arg-type]
    sw.rekey()  # a rotation's use while the old engine still runs a sequence
    assert (old.rekeyed, new.rekeyed) == (1, 1)
    second = sw.generate(request(1))
    new.step.set()
    await anext(second)
    assert sw.tokens == 2
    old.step.set()
    await anext(first)
    await first.aclose()
    await second.aclose()
    for _ in range(50):
        if old.closed and not sw.active_sequences():
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)  # the retired engine's count moved over
    assert old.closed and sw.tokens == 3  # the retired engine's tokens still count
    sw.rekey()
    assert (old.rekeyed, new.rekeyed) == (1, 2)  # closed engines are not told
    linking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await linking
    await sw.aclose()


def test_a_held_sequence_waits_for_a_switch_or_its_stages_back_within_its_bound() -> None:
    """``working`` (``replay.py``'s wait): the new engine once switched; None at the bound
    while the failed engine is still the current one and not ready."""
    async def go() -> tuple[object, object, float, object]:
        old, new = FakeEngine("old"), FakeEngine("new")
        sw = PipelineSwitch(old, hold_s=5.0)  # type: ignore[arg-type]
        began = time.monotonic()
        none = await sw.working(old, began + 0.3)  # type: ignore[arg-type]
        waited = time.monotonic() - began
        waiting = asyncio.create_task(sw.working(old, time.monotonic() + 30))  # type: ignore[arg-type]
        await settle()
        assert not waiting.done()
        sw.switch(new)  # type: ignore[arg-type]
        got = await asyncio.wait_for(waiting, 5)
        ready = FakeEngine("ready")
        ready.readiness = lambda: None  # type: ignore[method-assign]
        back = await PipelineSwitch(ready).working(ready, time.monotonic())  # type: ignore[arg-type]
        return none, got is new, waited, back is ready

    none, switched_to_new, waited, back = asyncio.run(go())
    assert none is None and 0.3 <= waited < 3, waited
    assert switched_to_new and back
