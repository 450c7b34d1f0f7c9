"""``net.link``: the link test between real agents on 127.0.0.1 over real MXCL: its
figures, a peer's refusals (a size above its bound, no link test at all), a peer that
stalls, and one nobody answers; every failure a ``LinkTestFailed`` whose kind is the step."""

from __future__ import annotations

import asyncio

import pytest

from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService
from mlxceld.net.dialer import connect_as
from mlxceld.net.errors import LinkTestFailed
from mlxceld.net.link import LinkReport, measure, serve_link
from mlxceld.wire import Envelope, MessageSpec, encode_envelope, parse_envelope
from mlxceld.wire.link_messages import CHUNK, MAX_PULL, PUSH_SPEC, LinkPush
from mlxceld.wire.messages import Error

from helpers import keys
from helpers.mxcl import CLIENT_ID, SECRET, run, running
from helpers.ports import free_port


async def measured(agent: AgentService, **kwargs: object) -> LinkReport:
    async with running(agent):
        return await measure(CLIENT_ID, agent.address, keyring=keys.keyring(SECRET),
                             **kwargs)  # type: ignore[arg-type]


def linked() -> AgentService:
    agent = AgentService(("127.0.0.1", 0), keys.keyring(SECRET))
    serve_link(agent)
    return agent


def test_the_figures_add_up_to_what_was_asked() -> None:
    agent = linked()
    report = run(measured(agent, pings=7, size=250_000, chunk=100_000, peer="that host"))
    body = report.to_json()
    assert (body["peer"], body["chunk_bytes"]) == ("that host", 100_000)
    assert body["address"].startswith("127.0.0.1:") and body["node_id"] is None
    assert len(report.rtts_s) == 7 and all(r > 0 for r in report.rtts_s)
    rtt = body["rtt_ms"]
    assert rtt["min"] <= rtt["median"] <= rtt["p90"] <= rtt["max"]
    assert report.sent.bytes == report.received.bytes == 250_000  # 3 chunks, the last short
    assert report.sent.seconds > 0 and report.received.seconds > 0


def test_a_pull_above_the_bound_is_refused_naming_the_field() -> None:
    async def ask_too_much() -> str:
        async with running(linked()) as agent:
            stream = await connect_as(CLIENT_ID, agent.address, keyring=keys.keyring(SECRET),
                                      channel=3, budget_s=2.0)
            try:
                await stream.send(encode_envelope({"t": "link_pull", "bytes": MAX_PULL + 1,
                                                   "chunk": CHUNK}))
                got = parse_envelope(await stream.recv(), {"error": MessageSpec()})
            finally:
                await stream.close()
        return Error.from_wire(got.header).reason

    reason = run(ask_too_much())
    assert reason.startswith("link_pull refused: link_pull field 'bytes' must be"), reason


def test_a_peer_without_the_link_test_refuses_it() -> None:
    bare = AgentService(("127.0.0.1", 0), keys.keyring(SECRET))  # an older daemon's agent
    with pytest.raises(LinkTestFailed) as err:
        run(measured(bare, pings=2, size=1000))
    assert err.value.kind == "refused" and "'link_push'" in err.value.message
    assert "upgrade" in err.value.hint


def test_a_peer_that_stops_answering_is_named_within_the_stall_bound() -> None:
    agent = AgentService(("127.0.0.1", 0), keys.keyring(SECRET))

    async def swallow(stream: MxclStream, message: Envelope) -> None:
        LinkPush.from_wire(message.header)  # taken, never acknowledged

    agent.add_handler(3, LinkPush.T, swallow, PUSH_SPEC)
    with pytest.raises(LinkTestFailed) as err:
        run(measured(agent, pings=1, size=1000, stall_s=0.3, peer="quiet"))
    assert err.value.kind == "stalled" and err.value.peer == "quiet"
    assert err.value.message == "peer quiet sent no link_ack within 0.3 s"


def test_nobody_listening_or_no_address_is_named() -> None:
    nobody = f"127.0.0.1:{free_port('127.0.0.1')}"
    for address, kind in ((nobody, "connect"), ("no port", "address")):
        with pytest.raises(LinkTestFailed) as err:
            run(measure(CLIENT_ID, address, keyring=keys.keyring(SECRET), pings=1, size=1,
                        connect_s=0.3))
        assert err.value.kind == kind and address in err.value.message


def test_sizes_out_of_bounds_are_refused_before_dialling() -> None:
    for pings, size in ((0, 1), (201, 1), (1, 0), (1, MAX_PULL + 1)):
        with pytest.raises(ValueError):
            asyncio.run(measure(CLIENT_ID, "127.0.0.1:1", keyring=keys.keyring(SECRET),
                                pings=pings, size=size))
