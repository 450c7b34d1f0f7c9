"""A peer's assignment shell (``Assignee``) meeting offers of several plans, over real MXCL
on loopback: a newer plan supersedes an undecided round, an older one is stale, a bad newer
one leaves the round alone, a committed round answers busy. The stage host is our own seam,
a fake whose prepare waits until the test lets it finish."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxceld import __version__
from mlxceld.cluster.assignment.offers import ASSIGNMENT_VERSION, Offer, PeerFacts
from mlxceld.cluster.assignment.peer import Assignee
from mlxceld.cluster.assignment.push import ASSIGNMENT_CHANNEL, COORDINATOR_SPECS, decided, sent
from mlxceld.cluster.lease import KEPT, Lease
from mlxceld.net import MxclStream, connect
from mlxceld.net.agent import AgentService
from mlxceld.state import Settings
from mlxceld.state.db import open_db
from mlxceld.state.events import EventLog
from mlxceld.state.plans import Assignments
from mlxceld.wire import Keyring
from mlxceld.wire.assignment_messages import Deactivate
from mlxceld.wire.envelope import encode_envelope, parse_envelope

from helpers import keys
from helpers.waiting import until

COORDINATOR = "127.0.0.1:19000"
PEER_HOST = "127.0.0.2"
MODEL = "ab" * 32
TOML = f"""
[cluster]
name = "c1"
pipeline_parallel_size = 1

[[nodes]]
id = "coordinator"
address = "{COORDINATOR}"
role = "coordinator"

[[nodes]]
id = "stage-0"
address = "{PEER_HOST}:19100"
role = "pipeline_stage"
rank = 0
layers = [0, 4]
"""


def offer(epoch: int, **change: Any) -> bytes:
    o = Offer(epoch=epoch, assignment_version=ASSIGNMENT_VERSION, package_version=__version__,
              cluster="c1", model_identity=MODEL, stage=0, layers=(0, 4), node_id="stage-0",
              port=19100, coordinator=COORDINATOR, toml=TOML)
    return encode_envelope(replace(o, **change).to_wire())


@dataclass
class HeldStage:
    """Prepare blocks until ``release(epoch)``; every call is noted."""

    calls: list[str] = field(default_factory=list)
    gates: dict[int, asyncio.Event] = field(default_factory=dict)

    def facts(self, port: int) -> PeerFacts:
        return PeerFacts(__version__, "c1", MODEL, 4, PEER_HOST, frozenset({port}),
                         model_family="llama")

    def gate(self, epoch: int) -> asyncio.Event:
        return self.gates.setdefault(epoch, asyncio.Event())

    async def prepare_stage(self, epoch: int, node_id: str, toml: str) -> None:
        self.calls.append(f"prepare {epoch}")
        await self.gate(epoch).wait()

    async def activate_stage(self) -> None:
        self.calls.append("activate")

    async def stop_stage(self) -> None:
        self.calls.append("stop")

    async def end_epoch(self, epoch: int) -> str | None:
        self.calls.append(f"end {epoch}")
        return f"plan {epoch}'s stage stopped"

    def loading(self) -> None:
        return None


@dataclass
class Peer:
    stage: HeldStage
    assignments: Assignments
    keyring: Keyring
    address: str
    lease: Lease | None = None

    async def dial(self, identity: str = COORDINATOR) -> MxclStream:
        host, _, port = self.address.rpartition(":")
        return await connect(host, int(port), keyring=self.keyring, identity=identity,
                             channel=ASSIGNMENT_CHANNEL, budget_s=5.0,
                             local_addr=("127.0.0.1", 0))


@contextlib.asynccontextmanager
async def running_peer(tmp_path: Path, lease_s: dict[str, float] | None = None
                       ) -> AsyncIterator[Peer]:
    """A peer on PEER_HOST; with ``lease_s`` (its ``"s"``: the length, changed at will),
    it keeps a lease on its plan's coordinator (cluster/lease.py)."""
    keyring = keys.keyring(secrets.token_bytes(32))
    db = open_db(tmp_path / "state.db")
    stage, assignments = HeldStage(), Assignments(db)
    agent = AgentService((PEER_HOST, 0), keyring)
    lease = None if lease_s is None else Lease(
        assignments, Settings(db), heard=agent.last_heard, length_s=lambda: lease_s["s"])
    assignee = Assignee(assignments, stage, keyring, identity=lambda: agent.address,
                        state_dir=tmp_path, enabled=True, events=EventLog(db),
                        leased=lease.refusal if lease else None)
    assignee.register(agent)
    async with asyncio.TaskGroup() as tg:
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        tg.create_task(agent.run(started))
        await started
        tg.create_task(assignee.run())
        try:
            yield Peer(stage, assignments, keyring, agent.address, lease)
        finally:
            assignee.close()
            await agent.aclose()


async def answer(stream: MxclStream, skip: str = "preparing") -> dict[str, Any]:
    """The next message on ``stream`` other than ``skip`` heartbeats, within 10 s."""
    async with asyncio.timeout(10):
        while True:
            env = parse_envelope(await stream.recv(), COORDINATOR_SPECS)
            if env.type != skip:
                return dict(env.header)


def test_a_newer_plan_supersedes_an_undecided_round(tmp_path: Path) -> None:
    async def go() -> None:
        async with running_peer(tmp_path) as peer:
            await scenario(peer)

    asyncio.run(go())


async def scenario(peer: Peer) -> None:
    old = await peer.dial()
    await old.send(offer(10))
    await until(lambda: "prepare 10" in peer.stage.calls, "plan 10 loading, undecided",
                timeout=10)
    new = await peer.dial()
    await new.send(offer(11))
    got = await answer(old)
    assert (got["t"], got["epoch"], got["reason"]) == ("aborted", 10, "superseded by plan 11")
    await until(lambda: "prepare 11" in peer.stage.calls, "plan 11 to be prepared", timeout=10)
    assert peer.stage.calls == ["prepare 10", "stop", "prepare 11"]
    row = peer.assignments.latest()
    assert row is not None and (row.epoch, row.state) == (11, "preparing")
    peer.stage.gate(11).set()
    assert (await answer(new))["t"] == "accepted"

    # An older plan is stale; a newer one that does not check out leaves plan 11 alone.
    late, bad = await peer.dial(), await peer.dial()
    await late.send(offer(10))
    got = await answer(late)
    assert (got["t"], got["code"]) == ("refused", "stale_epoch"), got
    await bad.send(offer(12, cluster="c2"))
    got = await answer(bad)
    assert (got["t"], got["code"], got["epoch"]) == ("refused", "cluster_name", 12), got
    row = peer.assignments.latest()
    assert row is not None and (row.epoch, row.state) == (11, "accepted")  # 12 unrecorded

    # Committed, plan 11 is decided: a newer offer is busy until it ends.
    await new.send(sent(decided("commit", 11)))
    assert (await answer(new))["t"] == "committed"
    busy = await peer.dial()
    await busy.send(offer(13))
    got = await answer(busy)
    assert (got["t"], got["code"]) == ("refused", "busy") and "plan 11" in got["reason"], got
    await new.send(sent(decided("activate", 11)))
    assert (await answer(new))["t"] == "active"
    assert peer.stage.calls[-1] == "activate"
    for s in (old, new, late, bad, busy):
        await s.close("done")


def test_deactivate_stops_the_stage_and_comes_only_from_the_coordinator(tmp_path: Path) -> None:
    async def go() -> None:
        async with running_peer(tmp_path) as peer:
            push = await peer.dial()
            await push.send(offer(20))
            peer.stage.gate(20).set()
            assert (await answer(push))["t"] == "accepted"
            for ask, reply in (("commit", "committed"), ("activate", "active")):
                await push.send(sent(decided(ask, 20)))
                assert (await answer(push))["t"] == reply

            stranger = await peer.dial("127.0.0.1:19001")
            await stranger.send(sent(Deactivate(20, "x")))
            got = await answer(stranger)
            assert (got["t"], got["code"]) == ("refused", "coordinator"), got
            assert got["reason"] == f"plan 20 came from {COORDINATOR}, not from 127.0.0.1:19001"
            assert "stop" not in peer.stage.calls

            told = await peer.dial()
            await told.send(sent(Deactivate(20, "mlxctl cluster deactivate")))
            assert (await answer(told))["t"] == "deactivated"
            assert peer.stage.calls.count("stop") == 1
            row = peer.assignments.latest()
            assert row is not None and (row.epoch, row.state) == (20, "deactivated")
            assert row.reason == f"deactivated by coordinator {COORDINATOR}"
            await told.send(sent(Deactivate(20, "again")))
            assert (await answer(told))["t"] == "deactivated"  # answered again, stopped once
            await told.send(sent(Deactivate(99, "?")))
            got = await answer(told)
            assert (got["t"], got["reason"]) == ("deactivated", "plan 99 never ran here")
            assert peer.stage.calls.count("stop") == 1
            for stream in (push, stranger, told):
                await stream.close("done")

    asyncio.run(go())


def test_the_coordinator_of_a_newer_plan_taken_here_may_deactivate_the_old_one(
        tmp_path: Path) -> None:
    """A standby that took the plan over (daemon/standby.py) offered a newer one, taken
    here: it may tell the old plan is over (its stage kept serving meanwhile); a third
    identity may not."""
    standby = "127.0.0.1:19001"

    async def go() -> None:
        async with running_peer(tmp_path) as peer:
            for epoch, who in ((20, COORDINATOR), (21, standby)):
                push = await peer.dial(who)
                await push.send(offer(epoch, coordinator=who, toml=TOML.replace(COORDINATOR, who)))
                peer.stage.gate(epoch).set()
                assert (await answer(push))["t"] == "accepted"
                for ask, reply in (("commit", "committed"), ("activate", "active")):
                    await push.send(sent(decided(ask, epoch)))
                    assert (await answer(push))["t"] == reply
                await push.close("done")
            third = await peer.dial("127.0.0.1:19002")
            await third.send(sent(Deactivate(20, "x")))
            got = await answer(third)
            assert (got["t"], got["code"]) == ("refused", "coordinator"), got
            told = await peer.dial(standby)
            await told.send(sent(Deactivate(20, "plan 21 serves in its place")))
            assert (await answer(told))["t"] == "deactivated"
            row = peer.assignments.get(20)
            assert row is not None and row.state == "deactivated", row
            assert peer.stage.calls[-1] == "end 20" and "stop" not in peer.stage.calls
            assert peer.assignments.latest() == peer.assignments.get(21)
            for stream in (third, told):
                await stream.close("done")

    asyncio.run(go())


def test_an_offer_of_another_coordinator_waits_for_the_lease_of_the_plans_coordinator(
        tmp_path: Path) -> None:
    """While the coordinator of the plan held here is heard (its lease runs), another's
    offer is refused (code ``lease``, the holder and the time left named) before any round:
    nothing recorded, nothing loaded. Once the lease ran out, the same offer is taken."""
    standby, length = "127.0.0.1:19001", {"s": 30.0}

    async def go() -> None:
        async with running_peer(tmp_path, length) as peer:
            push = await peer.dial()
            await push.send(offer(20))
            peer.stage.gate(20).set()
            assert (await answer(push))["t"] == "accepted"
            for ask, reply in (("commit", "committed"), ("activate", "active")):
                await push.send(sent(decided(ask, 20)))
                assert (await answer(push))["t"] == reply
            assert peer.lease is not None
            said = await peer.lease.answer((20, COORDINATOR, "active"))
            assert (said.holder, said.held) == (COORDINATOR, 20), said
            assert said.lease_s is not None and said.lease_s > 25, said

            other = await peer.dial(standby)
            late = offer(21, coordinator=standby, toml=TOML.replace(COORDINATOR, standby))
            await other.send(late)
            got = await answer(other)
            assert (got["t"], got["code"], got["final"]) == ("refused", "lease", False), got
            assert f"coordinator {COORDINATOR} holds this host's lease (plan 20, heard " \
                in got["reason"] and " s more" in got["reason"], got
            assert peer.stage.calls == ["prepare 20", "activate"]
            assert peer.assignments.latest() == peer.assignments.get(20)
            assert peer.assignments.get(21) is None
            kept = Settings(open_db(tmp_path / "state.db")).get(KEPT)
            assert isinstance(kept, dict) and (kept["holder"], kept["epoch"]) == (
                COORDINATOR, 20), kept

            length["s"] = 0.0  # the coordinator not heard for a lease's length
            said = await peer.lease.answer((20, COORDINATOR, "active"))
            assert said.lease_s == 0 and said.holder == COORDINATOR, said
            await other.send(late)
            peer.stage.gate(21).set()
            assert (await answer(other))["t"] == "accepted"
            for stream in (push, other):
                await stream.close("done")

    asyncio.run(go())
