"""A hybrid node as users run it: a real daemon with a cluster secret and a model serves its
engine on the serving listener (``[serve] serving_port``), shows the address in its
router's stats and ``mlxctl status``, and a ``RemoteEngine`` dialing it gets the greedy
tokens mlx-lm gives, as its own OpenAI port gives their text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai

from mlxceld.engine import GenerationRequest, SamplingParams
from mlxceld.models.identity import model_identity
from mlxceld.replicas.remote import RemoteEngine

from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.keys import keyring
from helpers.models import PROMPT, expected, greedy_reference
from helpers.mxcl import CLIENT_ID, SECRET
from helpers.ports import free_port
from helpers.replicas import linked
from helpers.waiting import until

N = 8
WAIT_S = 30.0  # generous: a loaded machine


def test_a_hybrid_daemon_serves_its_engine_to_routers(daemons: Daemons,
                                                      fixture_dir: Path) -> None:
    model = fixture_dir / "qwen3"
    port, serving_port = free_port(), free_port()
    host = Host(daemons, "hybrid", secret=SECRET,
                serve={"model": str(model), "port": port, "serving_port": serving_port})
    host.start()
    host.d.wait_worker("router", READY_S, state="running")
    stats = host.d.worker("router")["stats"]
    assert stats["serving"] == f"0.0.0.0:{serving_port}", stats
    assert f"serving listener at 0.0.0.0:{serving_port}" in host.d.ctl("status").stdout

    ids, reference, _ = greedy_reference(model, PROMPT, N)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    text = client.completions.create(model="qwen3", prompt=PROMPT, max_tokens=N,
                                     temperature=0).choices[0].text
    assert text == expected(model, PROMPT, N)

    async def remote_tokens() -> list[int]:
        async def resolve() -> str:
            return f"127.0.0.1:{serving_port}"

        remote = RemoteEngine("hybrid", resolve, keyring=keyring(SECRET), origin=CLIENT_ID,
                              model_identity=model_identity(model),
                              cluster="mlxcel-cluster", silence_s=3.0)
        async with linked(remote):
            await until(lambda: remote.state() == "up", "the hybrid attached", WAIT_S)
            request = GenerationRequest("r", ids, SamplingParams(max_tokens=N, temperature=0))
            return [out.token async for out in remote.generate(request)]

    got = asyncio.run(remote_tokens())
    assert got == reference[:len(got)] and len(got) >= 1
    assert host.d.terminate() == 0
