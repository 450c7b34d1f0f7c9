"""``DrainService`` (``drain/service.py``) over a real state database and a fake router
(our own seam, ``call_router``): the started hook hears the node and ``--force``, a drain
held for a re-plan is not said to the router (until its deadline), ``list`` gives each
drain's counts, and a second drain of a draining node (a new deadline, ``--force``) is
saved and said to the router."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mlxceld.drain import DrainService
from mlxceld.state import DrainRow, DrainsTable
from mlxceld.state.startup import start_state
from mlxceld.types import JSON


def test_held_drains_wait_and_each_drain_reports_its_counts(tmp_path: Path) -> None:
    state = start_state(tmp_path / "state.db", reset=False)
    told: list[JSON] = []
    answer: JSON = {"in_flight": 2, "finished": 1, "ended": 0}
    held = {"b"}
    started: list[tuple[str, bool]] = []

    async def router(args: JSON) -> JSON:
        told.append(args)
        return {"ok": True, **answer}

    service = DrainService(DrainsTable(state.db), state.events,
                           needs=lambda: frozenset({"a", "b", "c"}), call_router=router,
                           started=lambda node, force: started.append((node, force)),
                           held=lambda: frozenset(held))

    async def go() -> None:
        service.drain("a", None, True)  # --force: nothing is held for it
        service.drain("b", 60.0, False)
        assert started == [("a", True), ("b", False)]
        await service.push()
        assert [d["node"] for d in told[-1]["drains"]] == ["a"]  # b waits for its re-plan
        rows = {r["node_id"]: r for r in (d.to_json() for d in service.list())}
        assert (rows["a"]["in_flight"], rows["a"]["finished"], rows["a"]["replanning"]) == \
            (2, 1, False)
        assert (rows["b"]["in_flight"], rows["b"]["replanning"], rows["b"]["state"]) == \
            (None, True, "draining")
        held.clear()  # the re-plan gave up: b's drain is said to the router too
        answer.update(in_flight=0, finished=3)
        await service.push()
        assert [d["node"] for d in told[-1]["drains"]] == ["a", "b"]
        rows = {r["node_id"]: r for r in (d.to_json() for d in service.list())}
        assert all((r["state"], r["in_flight"], r["finished"]) == ("drained", 0, 3)
                   for r in rows.values()), rows
        # A drain is held for its re-plan up to its deadline, not past it.
        held.add("c")
        answer.update(in_flight=1)
        service.drain("c", 0.0, False)
        await service.push()
        assert [d["node"] for d in told[-1]["drains"]] == ["a", "b", "c"]

    asyncio.run(go())
    kinds = [e.kind for e in state.events.since(0, 100)]
    assert kinds.count("drain.started") == 3 and kinds.count("drain.drained") == 2, kinds


def test_a_second_drain_of_a_draining_node_is_saved_and_said_to_the_router(
        tmp_path: Path) -> None:
    """`mlxctl drain` again of a node already draining changes its drain, as the command
    says: the new deadline (``deadline_s`` from the second request), then ``--force``
    (the deadline is now), is what the state database holds (what a restarted daemon
    reads) and what the router is told."""
    state = start_state(tmp_path / "state.db", reset=False)
    told: list[JSON] = []

    async def router(args: JSON) -> JSON:
        told.append(args)
        return {"ok": True, "in_flight": 1, "finished": 0, "ended": 0}

    service = DrainService(DrainsTable(state.db), state.events,
                           needs=lambda: frozenset({"a"}), call_router=router)

    def saved() -> DrainRow:
        row = DrainsTable(state.db).get("a")  # a reader of its own, as after a restart
        assert row is not None and row.state == "draining"
        return row

    async def go() -> None:
        service.drain("a", None, False)  # no deadline
        await service.push()
        assert told[-1]["drains"] == [{"node": "a", "deadline": None}]
        before = time.time()
        service.drain("a", 60.0, False)  # again: a deadline a minute from now
        after = time.time()
        row = saved()
        assert row.deadline is not None and before + 60.0 <= row.deadline <= after + 60.0
        assert not row.force
        await service.push()
        assert told[-1]["drains"] == [{"node": "a", "deadline": row.deadline}]
        before = time.time()
        service.drain("a", None, True)  # again: --force, the deadline is now
        after = time.time()
        row = saved()
        assert row.force and row.deadline is not None and before <= row.deadline <= after
        await service.push()
        assert told[-1]["drains"] == [{"node": "a", "deadline": row.deadline}]

    asyncio.run(go())
    kinds = [e.kind for e in state.events.since(0, 100)]
    assert kinds.count("drain.started") == 1 and kinds.count("drain.changed") == 2, kinds


def test_an_undrain_while_the_router_is_asked_is_not_undone(tmp_path: Path) -> None:
    """``push`` reads the drains, then awaits the router: an undrain (or a drain started
    anew) that lands meanwhile is the later operator action and wins. The push's answer
    (nothing in flight) neither brings the undrained row back nor marks the new drain
    drained before the router was told it."""
    state = start_state(tmp_path / "state.db", reset=False)
    table = DrainsTable(state.db)
    asked = asyncio.Event()
    answer = asyncio.Event()

    async def router(args: JSON) -> JSON:
        asked.set()
        await answer.wait()
        return {"ok": True, "in_flight": 0, "finished": 0, "ended": 0}

    service = DrainService(table, state.events, needs=lambda: frozenset({"a", "b"}),
                           call_router=router)

    async def go() -> None:
        service.drain("a", None, False)
        service.drain("b", None, False)
        pushing = asyncio.create_task(service.push())
        await asyncio.wait_for(asked.wait(), 5)
        service.undrain("a")  # while the router is asked
        service.undrain("b")
        time.sleep(0.002)  # a drain started anew has a later start
        service.drain("b", None, False)
        answer.set()
        await asyncio.wait_for(pushing, 5)

    asyncio.run(go())
    assert table.get("a") is None
    b = table.get("b")
    assert b is not None and b.state == "draining", b
