"""A decode node's prefill peers (workers/handoff_node.py ``PrefillPeers``): the
identities a handoff may come from, asked of each peer's agent. Real agents on
127.0.0.1, real MXCL."""

from __future__ import annotations

import secrets

from mlxceld.discovery.serving import serve_serving
from mlxceld.net.agent import AgentService
from mlxceld.types import JSON
from mlxceld.wire.agent_messages import Serving
from mlxceld.workers.handoff_node import PrefillPeers

from helpers import keys
from helpers.mxcl import run, running

OURS = "a" * 64


async def peers_of(answer: JSON, host: str) -> frozenset[str]:
    """What ``PrefillPeers`` takes from one agent at ``host`` answering ``answer``."""
    ring = keys.keyring(secrets.token_bytes(32))
    agent = AgentService(("127.0.0.1", 0), ring)

    async def serving() -> Serving:
        return Serving(**answer)

    serve_serving(agent, serving)
    async with running(agent):
        port = agent.address.rsplit(":", 1)[1]
        peers = PrefillPeers((f"{host}:{port}",), origin="127.0.0.1:19999", keyring=ring,
                             model_identity=OURS)
        await peers._ask(f"{host}:{port}")
        return peers()


def test_a_prefill_peer_named_by_a_host_name_is_known_by_its_ips() -> None:
    """Handshakes bind IPs: a peer listed as "localhost" sends its handoffs as
    127.0.0.1:PORT. Before, "localhost:PORT" was kept, and every handoff was dropped."""
    answer = {"role": "prefill", "port": 40123, "model": OURS}
    assert "127.0.0.1:40123" in run(peers_of(answer, "localhost"))
    assert run(peers_of(answer, "127.0.0.1")) == {"127.0.0.1:40123"}


def test_a_peer_that_is_not_a_prefill_node_of_our_model_is_left_out() -> None:
    assert run(peers_of({"role": "decode", "port": 40123, "model": OURS}, "127.0.0.1")) == set()
    assert run(peers_of({"role": "prefill", "port": 40123, "model": "b" * 64},
                        "127.0.0.1")) == set()
