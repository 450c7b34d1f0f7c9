"""The agent listener's heartbeat (net/agent.py), in one process over loopback: a client
that stops reading (what a SIGSTOPped peer looks like from here: nothing read, no pong) is
dropped within ``silence_s``; a client that reads is kept while a handler takes longer than
``silence_s`` to answer (its stream is read ahead, its pongs heard)."""

from __future__ import annotations

import asyncio

from mlxceld.net import MxclStream, connect
from mlxceld.net.agent import AgentService
from mlxceld.wire import Envelope, encode_envelope, parse_envelope
from mlxceld.wire.envelope import MessageSpec

from helpers import keys
from helpers.mxcl import CLIENT_ID, SECRET, run, running
from helpers.waiting import until

SILENCE_S = 0.4
SLACK_S = 1.0  # a loaded machine's timers
DONE = {"done": MessageSpec()}


def agent_with_slow_handler() -> AgentService:
    agent = AgentService(("127.0.0.1", 0), keys.keyring(SECRET), silence_s=SILENCE_S)

    async def slow(stream: MxclStream, env: Envelope) -> None:
        await asyncio.sleep(3 * SILENCE_S)
        await stream.send(encode_envelope({"t": "done"}))

    agent.add_handler(3, "slow", slow)
    return agent


async def dial(agent: AgentService) -> MxclStream:
    host, port = agent.address.rsplit(":", 1)
    return await connect(host, int(port), keyring=keys.keyring(SECRET), identity=CLIENT_ID,
                         channel=3, budget_s=5)


def test_a_client_that_stops_reading_is_dropped_within_the_bound() -> None:
    async def go() -> float:
        async with running(agent_with_slow_handler()) as agent:
            stream = await dial(agent)  # and never read: the listener's pings go unanswered
            loop = asyncio.get_running_loop()
            began = loop.time()
            try:
                await until(lambda: agent.established == 0, "the listener to drop us",
                            timeout=SILENCE_S + 10)
                return loop.time() - began
            finally:
                await stream.abort()

    took = run(go())
    assert SILENCE_S * 0.8 <= took <= SILENCE_S + SLACK_S, took


def test_a_reading_client_outlives_a_slow_handler() -> None:
    async def go() -> None:
        async with running(agent_with_slow_handler()) as agent:
            stream = await dial(agent)
            try:
                for _ in range(2):
                    await stream.send(encode_envelope({"t": "slow"}))
                    assert parse_envelope(await stream.recv(), DONE).type == "done"
                assert agent.established == 1
            finally:
                await stream.close()

    run(go())
