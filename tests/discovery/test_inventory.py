"""The inventory message: this host's answer, its bounds, and the agent's dispatch table."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from mlxceld import __version__
from mlxceld.cluster.plan.candidates import plan_nodes
from mlxceld.discovery.candidates import CandidateTable
from mlxceld.discovery.inventory import (
    InventoryError,
    free_ports,
    local_inventory,
    parse_inventory,
    serve_inventory,
)
from mlxceld.discovery.poller import InventoryPoller
from mlxceld.models.identity import model_identity
from mlxceld.net import MxclStream, connect
from mlxceld.net.agent import AgentService
from mlxceld.wire import Envelope, MessageSpec, encode_envelope, parse_envelope

from helpers import keys
from helpers.mxcl import running


def model_dir(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    (root / "model.safetensors").write_bytes(b"\0" * 16)
    return root


def test_local_inventory_is_within_its_own_bounds(tmp_path: Path) -> None:
    inv = local_inventory("host-a", "127.0.0.1:19000", "127.0.0.1", None).to_wire()
    assert parse_inventory(inv).to_wire() == inv
    assert inv["version"] == __version__ and inv["model"] is None and len(inv["ports"]) == 3
    model = model_dir(tmp_path / "m")
    inv = local_inventory("host-a", "127.0.0.1:19000", "127.0.0.1", str(model)).to_wire()
    assert inv["model"] == {"path": str(model), "identity": model_identity(model), "error": None}
    missing = local_inventory("host-a", "0.0.0.0:19000", "0.0.0.0",
                              str(tmp_path / "nope")).to_wire()
    assert missing["model"]["identity"] is None and "nope" in missing["model"]["error"]
    assert parse_inventory(missing).to_wire() == missing


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports("127.0.0.1", 3)
    assert len(set(ports)) == 3 and all(1 <= p <= 65535 for p in ports)
    assert free_ports("192.0.2.1", 3) == []  # not an address of this host: nothing to offer


GOOD = local_inventory("host-a", "127.0.0.1:19000", "127.0.0.1", None).to_wire()


@pytest.mark.parametrize(("change", "words"), [
    ({"extra": 1}, "expected"),
    ({"node": ""}, "'node' must not be empty"),
    ({"node": "a\nb"}, "control character"),
    ({"version": ""}, "'version'"),
    ({"platform": {"system": "linux"}}, "'platform'"),
    ({"memory_total": -1}, "'memory_total'"),
    ({"memory_total": 1.5}, "'memory_total'"),
    ({"memory_available": True}, "'memory_available'"),
    ({"memory_total": 1, "memory_available": 2}, "above"),
    ({"model": {"path": "/m", "identity": "AB" * 32, "error": None}}, "'model.identity'"),
    ({"model": {"path": "/m", "identity": None, "error": None}}, "exactly one"),
    ({"model": {"path": "", "identity": "ab" * 32, "error": None}}, "'path'"),
    ({"ports": [1, 1]}, "'ports'"),
    ({"ports": list(range(1, 10))}, "'ports'"),
    ({"ports": [0]}, "'ports'"),
    ({"agent": ""}, "'agent'"),
    ({"compute_units": 0}, "'compute_units'"),
    ({"compute_units": -2.5}, "'compute_units'"),
    ({"compute_units": True}, "'compute_units'"),
    ({"compute_units": "fast"}, "'compute_units'"),
    ({"compute_units": None}, "'compute_units'"),
    ({"compute_units": float("inf")}, "'compute_units'"),
    ({"compute_units": float("nan")}, "'compute_units'"),
    ({"compute_units": 2e6}, "'compute_units'"),
])
def test_answers_out_of_bounds_are_refused(change: dict[str, Any], words: str) -> None:
    with pytest.raises(InventoryError, match=words):
        parse_inventory({**GOOD, **change})


def test_compute_units_travel_when_known_and_old_answers_parse() -> None:
    """The optional key: sent only when known, read back as a float; an answer without it
    (an agent that knows none, or an older one) parses with none."""
    assert "compute_units" not in GOOD and parse_inventory(GOOD).compute_units is None
    inv = local_inventory("host-a", "127.0.0.1:19000", "127.0.0.1", None,
                          compute_units=41.5).to_wire()
    assert inv["compute_units"] == 41.5
    assert parse_inventory(inv).compute_units == 41.5
    assert parse_inventory(inv).to_wire() == inv
    whole = parse_inventory({**GOOD, "compute_units": 3})
    assert whole.compute_units == 3.0 and type(whole.compute_units) is float


def test_handlers_are_per_channel_and_type() -> None:
    keyring = keys.keyring(secrets.token_bytes(32))
    agent = AgentService(("127.0.0.1", 0), keyring)

    async def noop(stream: MxclStream, message: Envelope) -> None: ...

    agent.add_handler(2, "offer", noop)
    with pytest.raises(ValueError, match="'offer' on channel 2"):
        agent.add_handler(2, "offer", noop)
    with pytest.raises(ValueError, match="channel 1"):
        agent.add_handler(1, "act", noop)


def test_inventory_and_another_handler_over_a_real_agent() -> None:
    keyring = keys.keyring(secrets.token_bytes(32))

    async def main() -> None:
        agent = AgentService(("127.0.0.1", 0), keyring)
        serve_inventory(agent, "host-b", lambda: None, units=lambda: 7.25)
        seen: list[tuple[str | None, dict[str, Any]]] = []

        async def offer(stream: MxclStream, message: Envelope) -> None:
            seen.append((stream.peer_identity, message.header))
            await stream.send(encode_envelope({"t": "accepted"}))

        agent.add_handler(2, "offer", offer)
        async with running(agent):
            table = CandidateTable(node_id="host-a")
            table.propose_static(agent.address, 0.0)
            await InventoryPoller(table, keyring, "127.0.0.1:19999").poll(agent.address)
            row = table.get(agent.address)
            assert row is not None and row.state == "reachable", row
            assert row.node_id == "host-b" and row.inventory and row.inventory["agent"] == (
                agent.address)
            assert row.inventory["compute_units"] == 7.25
            (node,), _ = plan_nodes([row], "ab" * 32)
            assert node.compute_units == 7.25 and node.node_id == "host-b"

            host, port = agent.address.rsplit(":", 1)
            async with await connect(host, int(port), keyring=keyring, channel=2,
                                     identity="127.0.0.1:19999", budget_s=5) as stream:
                specs = {"accepted": MessageSpec(), "error": MessageSpec()}
                await stream.send(encode_envelope({"t": "inventory"}))  # channel 3's only
                assert parse_envelope(await stream.recv(), specs).type == "error"
                await stream.send(encode_envelope({"t": "offer", "epoch": 1}))
                assert parse_envelope(await stream.recv(), specs).type == "accepted"
            assert seen == [("127.0.0.1:19999", {"t": "offer", "epoch": 1})]

    asyncio.run(main())


def test_bad_or_missing_answers_make_a_candidate_unreachable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxceld.discovery import poller

    monkeypatch.setattr(poller, "ANSWER_TIMEOUT_S", 0.3)
    keyring = keys.keyring(secrets.token_bytes(32))

    async def main() -> None:
        agent = AgentService(("127.0.0.1", 0), keyring)
        answers = [{"t": "inventory", "node": ""}, None]

        async def inventory(stream: MxclStream, message: Envelope) -> None:
            answer = answers.pop(0)
            if answer is not None:
                await stream.send(encode_envelope(answer))

        agent.add_handler(3, "inventory", inventory)
        async with running(agent):
            table = CandidateTable(node_id="host-a")
            table.propose_static(agent.address, 0.0)
            p = InventoryPoller(table, keyring, "127.0.0.1:19999")
            await p.poll(agent.address)
            row = table.get(agent.address)
            assert row is not None and row.state == "unreachable"
            assert row.error is not None and row.error.startswith("bad_inventory: inventory has")
            await p.poll(agent.address)
            row = table.get(agent.address)
            assert row is not None and row.error == "no_answer: no inventory answer within 0.3 s"

    asyncio.run(main())


def test_ring_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    import socket

    from mlxceld.discovery.inventory import RING_LOW, ephemeral_low, ring_ports

    low = ephemeral_low()
    ports = ring_ports("127.0.0.1", 3)
    assert len(set(ports)) == 3 and ports == sorted(ports), ports
    if low - RING_LOW >= 64:  # an outgoing connection never takes one as its source port
        assert all(RING_LOW <= p < low for p in ports), (ports, low)
    for port in ports:  # free: each binds now
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
