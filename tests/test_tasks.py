"""cancelling_group: a TaskGroup whose tasks are cancelled when its body ends, and which
swallows nothing else: a task's error and a cancellation from outside go through.
scoped_group: the same, its one exception raised as itself. Background: an owner's tasks,
a failure logged, all ended by its aclose."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mlxceld.tasks import Background, cancelling_group, scoped_group


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


def test_a_scoped_groups_one_error_comes_out_as_itself() -> None:
    async def body_raises() -> None:
        async with scoped_group() as tg:
            tg.create_task(asyncio.Event().wait())
            raise KeyError("body")

    async def task_raises() -> None:
        async def fails() -> None:
            raise ValueError("task")

        async with scoped_group() as tg:
            tg.create_task(fails())
            await asyncio.Event().wait()  # cancelled by the failure

    with pytest.raises(KeyError, match="body"):
        asyncio.run(body_raises())
    with pytest.raises(ValueError, match="task"):
        asyncio.run(task_raises())


def test_a_scoped_groups_body_end_cancels_what_still_runs() -> None:
    async def go() -> bool:
        async with scoped_group() as tg:
            waiting = tg.create_task(asyncio.Event().wait())
            await asyncio.sleep(0)
        return waiting.cancelled()

    assert asyncio.run(go()) is True


def test_background_logs_a_failure_and_its_aclose_ends_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> tuple[bool, bool, bool, int]:
        tasks = Background("engine m")

        async def fails() -> None:
            raise ValueError("lost?")

        async def forever() -> None:
            await asyncio.Event().wait()

        failed = tasks.spawn(fails())
        finishes = tasks.spawn(asyncio.sleep(0.01))
        hangs = tasks.spawn(forever())
        await asyncio.sleep(0)
        await tasks.aclose(within_s=0.2)  # quick ones finish; the rest are cancelled
        return failed.done(), finishes.done() and not finishes.cancelled(), \
            hangs.cancelled(), len(tasks)

    with caplog.at_level(logging.ERROR, logger="mlxceld.tasks"):
        assert asyncio.run(go()) == (True, True, True, 0)
    assert [r.getMessage() for r in caplog.records] == ["engine m: a task of its own failed"]
    assert "lost?" in caplog.text
