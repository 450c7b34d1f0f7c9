"""The ``serving`` exchange on the agent channel (discovery/serving.py): a router finds a
replica's serving listener from its agent address, or is told why there is none. Real
agents on 127.0.0.1, real MXCL."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import pytest

from mlxceld.discovery.serving import (
    ServingFinder,
    ServingNotFound,
    parse_serving,
    port_of,
    serve_serving,
)
from mlxceld.net.agent import AgentService
from mlxceld.types import JSON
from mlxceld.wire.agent_messages import Serving

from helpers import keys
from helpers.mxcl import run, running
from helpers.ports import free_port

OURS = "a" * 64
THEIRS = "b" * 64
ORIGIN = "127.0.0.1:19999"


@dataclass(frozen=True)
class Sent:
    """A ``serving`` answer as an agent sends it, within bounds or not."""

    header: JSON

    def to_wire(self) -> JSON:
        return {"t": "serving", **self.header}


async def find(answer: JSON, *, agent_keyring: Any = None,
               host: str = "127.0.0.1", role: str = "hybrid") -> str:
    """What a ``ServingFinder`` says of an agent answering ``answer``."""
    ring = keys.keyring(secrets.token_bytes(32))
    agent = AgentService(("127.0.0.1", 0), agent_keyring or ring)

    async def serving() -> Sent:
        return Sent(answer)

    serve_serving(agent, serving)
    async with running(agent):
        port = agent.address.rsplit(":", 1)[1]
        finder = ServingFinder(f"{host}:{port}", origin=ORIGIN, keyring=ring,
                               model_identity=OURS, role=role)
        return await finder()


def test_a_hybrid_serving_our_model_is_dialed_at_its_agents_host() -> None:
    answer = {"role": "hybrid", "port": 40123, "model": OURS}
    assert run(find(answer)) == "127.0.0.1:40123"
    assert run(find(answer, host="localhost")) == "localhost:40123"  # a name stays a name


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_prefill_or_decode_node_named_by_a_host_name_is_found_at_an_ip(role: str) -> None:
    """Its address is an identity (a handoff's sender, an allowlisted decode target), and
    handshakes bind IPs: a name is resolved (IPv4 first). Before, "localhost:40123" went
    on the wire, matched no handshake and no allowlist, and every request failed."""
    answer = {"role": role, "port": 40123, "model": OURS}
    assert run(find(answer, host="localhost", role=role)) == "127.0.0.1:40123"
    assert run(find(answer, role=role)) == "127.0.0.1:40123"


@pytest.mark.parametrize(("answer", "words"), [
    ({"role": "hybrid", "port": 40123, "model": THEIRS}, "serves another model (identity "
     "bbbbbbbbbbbb…, ours aaaaaaaaaaaa…): give every replica the same model files"),
    ({"role": "hybrid", "port": None, "model": OURS}, "has no serving listener (yet)"),
    ({"role": "hybrid", "port": 40123, "model": None}, "serves no model (yet)"),
    ({"role": "router", "port": None, "model": OURS}, "is a router, not a hybrid node"),
    ({"role": "hybrid", "port": 0, "model": OURS}, "a port outside 1-65535"),
    ({"role": "hybrid", "port": 1, "model": OURS, "extra": 1}, "with keys"),
])
def test_why_there_is_nothing_to_dial_is_said(answer: JSON, words: str) -> None:
    with pytest.raises(ServingNotFound) as err:
        run(find(answer))
    assert words in err.value.message, err.value.message
    assert "127.0.0.1" not in err.value.message  # a member's error reaches clients


def test_an_agent_without_the_message_or_another_secret_or_none_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxceld.discovery import serving

    monkeypatch.setattr(serving, "CONNECT_BUDGET_S", 0.5)  # the dialer's retries on a refusal
    async def unserved() -> str:
        ring = keys.keyring(secrets.token_bytes(32))
        agent = AgentService(("127.0.0.1", 0), ring)  # an older mlxceld: no 'serving'
        async with running(agent):
            return await ServingFinder(agent.address, origin=ORIGIN, keyring=ring,
                                       model_identity=OURS)()

    with pytest.raises(ServingNotFound, match="does not answer 'serving'"):
        run(unserved())
    other = keys.keyring(secrets.token_bytes(32))
    with pytest.raises(ServingNotFound, match=r"^its agent cannot be reached \(\w+\): is "
                       r"its daemon up, with the same cluster secret\?$"):
        run(find({"role": "hybrid", "port": 1, "model": OURS}, agent_keyring=other))
    nobody = f"127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(ServingNotFound, match=r"^its agent cannot be reached \(unreachable\)"):
        run(ServingFinder(nobody, origin=ORIGIN, keyring=other, model_identity=OURS)())


def test_the_port_is_read_from_the_router_stats_in_any_of_its_shapes() -> None:
    assert port_of({"serving": 4000}) == 4000
    assert port_of({"serving": {"port": 4001, "address": "0.0.0.0:4001"}}) == 4001
    assert port_of({"serving": "[::]:4002"}) == 4002
    for stats in (None, {}, {"serving": None}, {"serving": 0}, {"serving": "nonsense"},
                  {"serving": True}):
        assert port_of(stats) is None
    assert parse_serving(Serving("hybrid", None, None).to_wire()).port is None
