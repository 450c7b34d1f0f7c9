"""The coordinator's push (``assignment.push``) when a peer's connection comes up only after
the decision: it got its offer, so it must hear the decision before the connection closes.

Two fake peers on real MXCL listeners on loopback record what they receive; A refuses its
offer. The plan lists B first, so the abort to B is due while B is still connecting and is
skipped; B's dial is held (a wrapper around ``connect_as``, our own seam) until the abort to A
is being sent, and that send yields a moment, so B registers and gets its offer just then.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mlxceld.cluster.assignment import push as assignment
from mlxceld.cluster.assignment.push import (
    ASSIGNMENT_CHANNEL,
    PEER_SPECS,
    PushPlan,
    StageOffer,
    epoch_of,
    push,
    sent,
)
from mlxceld.net import ConnectionClosed, Listener, MxclStream
from mlxceld.state.db import open_db
from mlxceld.state.plans import Plans
from mlxceld.wire import Keyring
from mlxceld.wire.assignment_messages import Refused
from mlxceld.wire.envelope import parse_envelope

from helpers import keys

COORDINATOR = "127.0.0.1:19000"
MODEL = "ab" * 32


@dataclass
class FakePeer:
    """A peer's agent listener that notes each message until the connection closes; one
    that ``refuses`` answers an offer with a final refusal."""

    refuses: bool
    got: list[tuple[str, int | None]] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, stream: MxclStream) -> None:
        try:
            while True:
                env = parse_envelope(await stream.recv(), PEER_SPECS)
                self.got.append((env.type, epoch_of(env.header)))
                if env.type == "offer" and self.refuses:
                    await stream.send(sent(Refused(env.header["epoch"], "model",
                                                   "this node has another model", final=True)))
        except ConnectionClosed:
            self.closed.set()


class AbortYields:
    """A's stream: sending the abort lets B's dial go on, and yields while B's offer goes out."""

    def __init__(self, stream: MxclStream, aborting: asyncio.Event) -> None:
        self.stream, self.aborting = stream, aborting

    def __getattr__(self, name: str) -> Any:  # the rest as the stream's (heard_at, ...)
        return getattr(self.stream, name)

    async def send(self, payload: bytes) -> None:
        if parse_envelope(payload, PEER_SPECS).type == "abort":
            self.aborting.set()
            await asyncio.sleep(0.05)  # the window: B's dial registers and sends its offer
        await self.stream.send(payload)

    async def recv(self) -> bytes:
        return await self.stream.recv()

    async def close(self, reason: str = "") -> None:
        await self.stream.close(reason)


def test_a_peer_connected_after_the_abort_hears_it(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        keyring = keys.keyring(secrets.token_bytes(32))
        b, a = FakePeer(refuses=False), FakePeer(refuses=True)
        listeners = [Listener(host, 0, keyring=keyring, identity_of_server=f"{host}:0",
                              channels={ASSIGNMENT_CHANNEL}, handler=peer.serve)
                     for host, peer in (("127.0.0.2", b), ("127.0.0.3", a))]
        async with asyncio.TaskGroup() as tg:
            for lst in listeners:
                await lst.start()
                tg.create_task(lst.serve())
                await asyncio.wait_for(lst.wait_accepting(), 10)
            try:
                await scenario(keyring, b, a, [f"{lst.host}:{lst.port}" for lst in listeners],
                               Plans(open_db(tmp_path / "coordinator.db")), monkeypatch)
            finally:
                for lst in listeners:
                    await lst.aclose()
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(go())


async def scenario(keyring: Keyring, b: FakePeer, a: FakePeer, agents: list[str],
                   plans: Plans, monkeypatch: pytest.MonkeyPatch) -> None:
    b_agent, a_agent = agents
    b_connected, aborting = asyncio.Event(), asyncio.Event()
    real_connect = assignment.connect_as

    async def held_connect(origin: str, address: str, **kwargs: Any) -> Any:
        """A's stream once B is connected (so B's dial only waits on the abort); B's once
        the abort to A is being sent."""
        stream = await real_connect(origin, address, **kwargs)
        is_b = address == b_agent
        try:
            if is_b:
                b_connected.set()
                await asyncio.wait_for(aborting.wait(), 10)
            else:
                await asyncio.wait_for(b_connected.wait(), 10)
        except BaseException:
            await stream.close("test over")
            raise
        return stream if is_b else AbortYields(stream, aborting)

    monkeypatch.setattr(assignment, "connect_as", held_connect)
    plan = PushPlan("c1", MODEL, "", (StageOffer(b_agent, 0, (0, 2), "stage-0", 19100),
                                      StageOffer(a_agent, 1, (2, 4), "stage-1", 19101)))
    epoch, done = await asyncio.wait_for(
        push(plan, plans=plans, keyring=keyring, identity=COORDINATOR), 10)

    assert not done.ok
    assert f"{a_agent}: refused: model: this node has another model" in done.summary, done
    row = plans.get(epoch)
    assert row is not None and row.decision == "abort"
    for peer in (a, b):
        await asyncio.wait_for(peer.closed.wait(), 10)
    assert a.got == [("offer", epoch), ("abort", epoch)]
    assert b.got == [("offer", epoch), ("abort", epoch)]  # the decision before the close
