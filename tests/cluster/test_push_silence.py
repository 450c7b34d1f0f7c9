"""The coordinator's push does not hold a connection to a silent peer: a fake peer on a
real MXCL listener takes its offer, then reads nothing more (a process stopped, a host
asleep: no RST, no pong to the push's pings). Its connection is lost within
``push.SILENCE_S`` and, before the decision, the plan aborts naming it, instead of waiting
out the offer phase (``PUSH_S - COMMIT_WINDOW_S``: 50 s)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from mlxceld.cluster.assignment.push import (
    ASSIGNMENT_CHANNEL,
    PEER_SPECS,
    SILENCE_S,
    PushPlan,
    StageOffer,
    push,
)
from mlxceld.net import Listener, MxclStream
from mlxceld.state.db import open_db
from mlxceld.state.plans import Plans
from mlxceld.wire.envelope import parse_envelope

from helpers import keys

SLACK_S = 2.0  # a loaded machine's timers


def test_a_peer_silent_after_its_offer_aborts_the_plan_within_the_bound(
        tmp_path: Path) -> None:
    got: list[str] = []
    release = asyncio.Event()

    async def silent(stream: MxclStream) -> None:
        got.append(parse_envelope(await stream.recv(), PEER_SPECS).type)
        await release.wait()  # reads nothing more: the push's pings go unanswered

    async def go() -> tuple[float, bool, str]:
        keyring = keys.keyring(secrets.token_bytes(32))
        lst = Listener("127.0.0.2", 0, keyring=keyring, identity_of_server="127.0.0.2:0",
                       channels={ASSIGNMENT_CHANNEL}, handler=silent)
        await lst.start()
        plan = PushPlan("c1", "ab" * 32, "", (StageOffer(f"127.0.0.2:{lst.port}", 0, (0, 2),
                                                         "stage-0", 19100),))
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(lst.serve())
            await lst.wait_accepting()
            began = loop.time()
            try:
                _, done = await asyncio.wait_for(push(
                    plan, plans=Plans(open_db(tmp_path / "c.db")), keyring=keyring,
                    identity="127.0.0.1:19000"), 60)
            finally:
                release.set()
                await lst.aclose()
        return loop.time() - began, done.ok, done.summary

    took, ok, summary = asyncio.run(go())
    print(f"\na push to a silent peer ended after {took:.2f} s (bound {SILENCE_S:g} s)")
    assert got == ["offer"]
    assert not ok and "nothing heard for" in summary, summary
    assert SILENCE_S * 0.8 <= took <= SILENCE_S + SLACK_S, took
