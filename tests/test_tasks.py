"""cancelling_group: a TaskGroup whose tasks are cancelled when its body ends, and which
swallows nothing else: a task's error and a cancellation from outside go through."""

from __future__ import annotations

import asyncio

import pytest

from mlxceld.tasks import cancelling_group


def test_the_end_of_the_body_cancels_what_still_runs() -> None:
    async def go() -> tuple[bool, bool, list[str]]:
        done: list[str] = []

        async def quick() -> None:
            done.append("quick")

        async def forever() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                done.append("forever cleaned up")

        async with cancelling_group() as tg:
            finished = tg.create_task(quick())
            waiting = tg.create_task(forever())
            await asyncio.sleep(0)
        return finished.cancelled(), waiting.cancelled(), done

    assert asyncio.run(go()) == (False, True, ["quick", "forever cleaned up"])


def test_a_task_error_ends_the_body_and_propagates() -> None:
    async def go() -> None:
        async def fails() -> None:
            raise ValueError("boom")

        async with cancelling_group() as tg:
            tg.create_task(fails())
            await asyncio.Event().wait()  # cancelled by the failure

    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(go())
    assert [type(e) for e in info.value.exceptions] == [ValueError]


def test_an_error_in_the_body_propagates() -> None:
    async def go() -> None:
        async with cancelling_group() as tg:
            tg.create_task(asyncio.Event().wait())
            raise KeyError("body")

    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(go())
    assert [type(e) for e in info.value.exceptions] == [KeyError]


def test_a_cancellation_from_outside_is_not_swallowed() -> None:
    async def go() -> tuple[bool, bool]:
        inner: list[asyncio.Task[bool]] = []

        async def owner() -> None:
            async with cancelling_group() as tg:
                inner.append(tg.create_task(asyncio.Event().wait()))
                await asyncio.Event().wait()

        task = asyncio.create_task(owner())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled(), inner[0].cancelled()

    assert asyncio.run(go()) == (True, True)
