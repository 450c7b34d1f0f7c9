"""An operator's drain of a serving listener (``ServingService.drain``), in one process: a
real local engine (the tiny llama fixture: no end of sequence within 1500 greedy tokens
of "Once upon a time") served by a real hybrid ``ServingService`` on 127.0.0.1, a
router's ``RemoteEngine`` with real keys. New sequences are refused with ``draining``
(the router's member then says so: ``draining_until``), the one held runs to its end,
``drain_state`` names the router while it runs, the deadline ends what is still held
with ``draining``, and ``undrain`` admits again."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxceld.engine import EngineUnavailable, SamplingParams
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.net import connect_as
from mlxceld.replicas.messages import Cancel, Generate
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.replicas.service import ServingService
from mlxceld.wire import encode_envelope
from mlxceld.wire.transport_messages import Attach

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, accepting, run
from helpers.replicas import linked, request, tokens
from helpers.waiting import until

MODEL = "cd" * 32
CLUSTER = "drain-test"
SILENCE_S = 5.0
WAIT_S = 10.0  # generous: a loaded machine; no assertion here is about time


@pytest.fixture(scope="module")
def node(fixture_dir: Path) -> Iterator[tuple[LocalEngine, Any]]:
    engine, tokenizer = load_local_engine(str(fixture_dir / "llama"), max_batch=4)
    yield engine, tokenizer
    asyncio.run(engine.aclose())


def service_of(engine: LocalEngine) -> ServingService:
    return ServingService(engine, node_id="hybrid-a", role="hybrid", model_identity=MODEL,
                          cluster=CLUSTER, keyring=keyring(SECRET), address="127.0.0.1:0",
                          silence_s=SILENCE_S, vocab_size=engine.vocab_size)


def remote(service: ServingService) -> RemoteEngine:
    async def resolve() -> str:
        return f"{service.host}:{service.port}"

    return RemoteEngine(service.node_id, resolve, keyring=keyring(SECRET), origin=CLIENT_ID,
                        model_identity=MODEL, cluster=CLUSTER, silence_s=SILENCE_S,
                        dial_budget_s=2.0)


def test_a_drained_listener_refuses_new_sequences_finishes_held_ones_and_admits_again(
        node: tuple[LocalEngine, Any]) -> None:
    engine, tokenizer = node
    ids = tokenizer.encode("Once upon a time")

    async def main() -> None:
        service = service_of(engine)
        await service.start()
        async with accepting(service.serve, service.aclose), linked(remote(service)) as r:
            await until(lambda: r.state() == "up", "the router's link up", WAIT_S)
            held = r.generate(request(ids, 40, temperature=0))
            first = await anext(held)
            service.drain(None)
            state = service.drain_state()
            assert state["in_flight"] == 1
            assert state["senders"] == [{"router": CLIENT_ID, "sequences": 1}]
            with pytest.raises(EngineUnavailable, match="hybrid-a is draining"):
                await tokens(r, request(ids, 4, temperature=0))
            # the router's member says so: a pool passes it over meanwhile
            assert r.draining_until > asyncio.get_running_loop().time()
            rest = [out async for out in held]  # the held sequence runs to its end
            assert 1 + len(rest) == 40 and rest[-1].finish_reason == "length", first
            await until(lambda: service.drain_state()["in_flight"] == 0, "held one ended",
                        WAIT_S)
            state = service.drain_state()
            assert (state["finished"], state["ended"], state["senders"]) == (1, 0, [])
            service.undrain()
            assert len(await tokens(r, request(ids, 4, temperature=0))) == 4

    run(main())


def test_the_drains_deadline_ends_what_is_still_held_with_draining(
        node: tuple[LocalEngine, Any]) -> None:
    engine, tokenizer = node
    ids = tokenizer.encode("Once upon a time")

    async def main() -> None:
        service = service_of(engine)
        await service.start()
        async with accepting(service.serve, service.aclose), linked(remote(service)) as r:
            await until(lambda: r.state() == "up", "the router's link up", WAIT_S)
            held = r.generate(request(ids, 1400, temperature=0))
            await anext(held)
            service.drain(time.time() + 0.3)
            with pytest.raises(EngineUnavailable, match="draining"):
                async with asyncio.timeout(WAIT_S):
                    async for _ in held:
                        pass
            await until(lambda: service.drain_state()["in_flight"] == 0, "cut", WAIT_S)
            state = service.drain_state()
            assert (state["finished"], state["ended"]) == (0, 1), state
            assert engine.active_sequences() == 0  # the engine's sequence ended too

    run(main())


def test_a_sequence_cancelled_right_behind_its_generate_is_not_left_held(
        node: tuple[LocalEngine, Any]) -> None:
    """A router's ``generate`` and its ``cancel`` in one write: the node may take both
    before the sequence's task first runs. It is not left among the held ones (its drain
    would wait for it for ever), and the router's next sequences run."""
    engine, tokenizer = node
    ids = tokenizer.encode("Once upon a time")

    async def main() -> None:
        service = service_of(engine)
        await service.start()
        async with accepting(service.serve, service.aclose):
            stream = await connect_as(CLIENT_ID, f"{service.host}:{service.port}",
                                      keyring=keyring(SECRET), channel=1)
            await stream.send(encode_envelope(Attach(MODEL, CLUSTER).to_wire()))
            prompt = [("prompt", "i32", (1, len(ids)), struct.pack(f"<{len(ids)}i", *ids))]
            for i in range(20):
                seq = f"s{i}"
                # Both in one write (a forger's use of the connection's sans-IO core: the
                # generate sealed, not written, then the cancel's send writes both), so the
                # node reads them in one chunk and cancels before the sequence's task runs.
                stream._conn.send_message(encode_envelope(
                    Generate(seq, SamplingParams(max_tokens=50)).to_wire(), prompt))
                await stream.send(encode_envelope(Cancel(seq).to_wire()))
            service.drain(None)
            await until(lambda: service.drain_state()["in_flight"] == 0,
                        "no cancelled sequence held", WAIT_S)
            assert service.drain_state()["senders"] == []
            await stream.close("done")

    run(main())
