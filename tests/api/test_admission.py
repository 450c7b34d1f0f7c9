"""Admission: slots, a first-come-first-served queue, refusal past it, leaving it."""

from __future__ import annotations

import asyncio

import pytest

from mlxceld.api import ApiError
from mlxceld.api.edge.admission import Admission


async def hold(admission: Admission, name: str, order: list[str], release: asyncio.Event) -> None:
    async with admission.slot():
        order.append(name)
        await release.wait()


def test_slots_queue_in_order_and_refuse_past_the_queue() -> None:
    async def main() -> None:
        admission = Admission(max_active=2, max_queued=2)
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abcd"}
        async with asyncio.TaskGroup() as tg:
            for name in "abcd":
                tg.create_task(hold(admission, name, order, release[name]))
                await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert (order, admission.active, admission.queued) == (["a", "b"], 2, 2)
            with pytest.raises(ApiError) as caught:
                async with admission.slot():
                    pass
            error = caught.value
            assert (error.status, error.code, error.type) == (503, "overloaded", "server_error")
            assert error.headers["Retry-After"] == "1"
            release["b"].set()
            await asyncio.sleep(0.01)
            assert order == ["a", "b", "c"]
            release["a"].set()
            await asyncio.sleep(0.01)
            assert order == ["a", "b", "c", "d"]
            release["c"].set()
            release["d"].set()
        assert (admission.active, admission.queued) == (0, 0)

    asyncio.run(main())


def test_a_waiter_that_leaves_gives_up_its_place() -> None:
    async def main() -> None:
        admission = Admission(max_active=1, max_queued=2)
        order: list[str] = []
        release = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(hold(admission, "a", order, release))
            await asyncio.sleep(0)
            leaver = tg.create_task(hold(admission, "b", order, release))
            tg.create_task(hold(admission, "c", order, release))
            await asyncio.sleep(0)
            assert admission.queued == 2
            leaver.cancel()
            await asyncio.sleep(0)
            assert admission.queued == 1
            release.set()
        assert order == ["a", "c"]
        assert admission.active == 0

    asyncio.run(main())


def test_a_waiter_cancelled_as_it_is_handed_a_slot_passes_it_on() -> None:
    async def main() -> None:
        admission = Admission(max_active=1, max_queued=2)
        order: list[str] = []
        release = asyncio.Event()
        first = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(hold(admission, "a", order, first))
            await asyncio.sleep(0)
            unlucky = tg.create_task(hold(admission, "b", order, release))
            tg.create_task(hold(admission, "c", order, release))
            await asyncio.sleep(0)
            first.set()
            await asyncio.sleep(0)  # "a" leaves and hands its slot to "b"...
            unlucky.cancel()  # ...which is cancelled before it runs again
            release.set()
        assert order == ["a", "c"]
        assert (admission.active, admission.queued) == (0, 0)

    asyncio.run(main())


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        Admission(max_active=0, max_queued=1)


def test_capacity_is_followed_growing_hands_slots_to_waiters_shrinking_as_they_end() -> None:
    async def main() -> None:
        cap = [0]
        admission = Admission(1, 4, capacity=lambda: cap[0])
        assert admission.max_active == 1  # none yet: one admitted, the engine answers
        gate = asyncio.Event()
        entered: list[str] = []

        async def hold(name: str) -> None:
            async with admission.slot():
                entered.append(name)
                await gate.wait()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(hold("a"))
            await asyncio.sleep(0)
            tg.create_task(hold("b"))
            await asyncio.sleep(0)
            assert (entered, admission.queued) == (["a"], 1)
            cap[0] = 3  # a member joined: the next request hands "b" its slot too
            tg.create_task(hold("c"))
            for _ in range(3):
                await asyncio.sleep(0)
            assert sorted(entered) == ["a", "b", "c"] and admission.active == 3
            cap[0] = 1  # retired: the slots go as sequences end
            tg.create_task(hold("d"))
            await asyncio.sleep(0)
            assert admission.queued == 1 and admission.max_active == 1
            gate.set()
        assert entered[-1] == "d" and (admission.active, admission.queued) == (0, 0)

    asyncio.run(main())
