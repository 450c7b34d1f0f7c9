"""A stage host's lease on its plan's coordinator (cluster/lease.py), over a real SQLite
state: who holds it, when it runs out, a restarted host's conservative start, the record
kept in the settings table."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mlxceld.cluster.lease import KEPT, Lease
from mlxceld.state import Settings
from mlxceld.state.db import open_db
from mlxceld.state.plans import Assignments
from mlxceld.wire.address import HostPort, parse_address

HOLDER, OTHER = "10.0.0.1:19000", "10.0.0.5:19000"


def test_the_plans_coordinator_holds_the_lease_for_the_dead_time_from_last_heard(
        tmp_path: Path) -> None:
    db = open_db(tmp_path / "state.db")
    assignments = Assignments(db)
    heard: dict[HostPort, float] = {}
    lease = Lease(assignments, Settings(db), heard=lambda: heard, length_s=lambda: 10.0)
    other, holder = parse_address(OTHER), parse_address(HOLDER)

    async def go() -> None:
        assert await lease.current() is None  # no stage held: no lease
        assert await lease.refusal(other, 6) is None
        assignments.record(5, HOLDER, 0, "active", "")
        # Not heard since this start: live for a lease's length from the start.
        held = await lease.current()
        assert held is not None and (held.holder, held.epoch) == (HOLDER, 5)
        assert held.heard_at == lease.started and 9 < held.left_s(time.time()) <= 10
        why = await lease.refusal(other, 6)
        assert why is not None and f"coordinator {HOLDER} holds this host's lease (plan 5" \
            in why and "runs" in why, why
        assert await lease.refusal(holder, 6) is None  # the holder's own offer
        kept = Settings(db).get(KEPT)
        assert isinstance(kept, dict) and kept["holder"] == HOLDER and kept["epoch"] == 5

        lease.started -= 60  # the host started a minute ago, its coordinator heard 11 s ago
        heard[holder] = time.time() - 11
        heard[HostPort("10.0.0.5", 19000, other.ip)] = time.time()  # another: not the holder
        held = await lease.current()
        assert held is not None and held.left_s(time.time()) == 0
        assert await lease.refusal(other, 6) is None
        answer = await lease.answer((5, HOLDER, "active"))
        assert answer.lease_s == 0 and answer.heard_s is not None and answer.heard_s >= 11

        heard[holder] = time.time() - 1  # heard again: the lease runs again
        assert await lease.refusal(other, 6) is not None
        assignments.record(5, HOLDER, 0, "deactivated", "")  # its plan over: no lease
        assert await lease.current() is None and await lease.refusal(other, 6) is None
        assert (await lease.answer((5, HOLDER, "deactivated"))).holder is None

    asyncio.run(go())
