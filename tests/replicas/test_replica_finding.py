"""A router node's replica that cannot be used says why in its member's ``last_error``,
stays down and is asked again at the next dial: a real ``RemoteEngine`` whose resolve is
the real ``ServingFinder`` (discovery/serving.py) over a real agent on 127.0.0.1."""

from __future__ import annotations

import secrets

from mlxceld.discovery.serving import ServingFinder, serve_serving
from mlxceld.net.agent import AgentService
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.wire.agent_messages import Serving

from helpers import keys
from helpers.mxcl import CLIENT_ID, run, running
from helpers.replicas import linked
from helpers.waiting import until

OURS = "a" * 64
THEIRS = "b" * 64
WAIT_S = 10.0  # generous: a loaded machine; nothing here is about time


def test_a_replica_serving_another_model_is_named_and_asked_again() -> None:
    answers: list[Serving] = [Serving("hybrid", 40123, THEIRS)]
    asked: list[int] = []

    async def main() -> None:
        ring = keys.keyring(secrets.token_bytes(32))
        agent = AgentService(("127.0.0.1", 0), ring)

        async def serving() -> Serving:
            asked.append(1)
            return answers[-1]

        serve_serving(agent, serving)
        async with running(agent):
            find = ServingFinder(agent.address, origin=CLIENT_ID, keyring=ring,
                                 model_identity=OURS)
            remote = RemoteEngine("replica-0", find, keyring=ring, origin=CLIENT_ID,
                                  model_identity=OURS, cluster="c", silence_s=1.0)
            async with linked(remote):
                await until(lambda: remote.state() == "down", "replica-0 down", WAIT_S)
                error = remote.last_error()
                assert error is not None and error.startswith(
                    "node replica-0: its serving address is not known: it serves another "
                    "model (identity bbbbbbbbbbbb…, ours aaaaaaaaaaaa…)"), error
                answers.append(Serving("hybrid", None, OURS))
                await until(lambda: "has no serving listener" in (remote.last_error() or ""),
                            "asked again at the next dial", WAIT_S)
                assert remote.state() == "down" and len(asked) >= 2

    run(main())
