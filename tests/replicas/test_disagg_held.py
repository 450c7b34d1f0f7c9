"""A decode node's held handoffs (``replicas/held.py``) in one process: a real local
engine (the tiny fixture, loaded once), a real prefill node and a real decode node
(``HandoffService`` on 127.0.0.1) and a router's ``DisaggEngine`` over them, real keys.
The handoff beats its ``expect`` (the decode node takes each ``expect`` late: the
``failpoints.EXPECT_DELAY_S`` test knob), or comes from a prefill node the decode node
does not know yet (as after that node's restart on a new port)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxceld import failpoints
from mlxceld.engine import EngineUnavailable
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.net import connect_as
from mlxceld.replicas.disagg import FIRST_TOKEN_S, DisaggEngine
from mlxceld.replicas.handoffs import HandoffService
from mlxceld.replicas.held import HeldHandoffs
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.wire import encode_envelope

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, accepting, run
from helpers.replicas import linked, request, tokens
from helpers.waiting import until

MODEL = "cd" * 32
CLUSTER = "held-test"
SILENCE_S = 5.0
WAIT_S = 10.0  # generous: a loaded machine
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def node(fixture_dir: Path) -> Iterator[tuple[LocalEngine, Any]]:
    engine, tokenizer = load_local_engine(str(fixture_dir / "qwen3"), max_batch=4)
    yield engine, tokenizer
    asyncio.run(engine.aclose())


@contextlib.asynccontextmanager
async def service(engine: Any, node_id: str, role: str,
                  **changes: Any) -> AsyncIterator[HandoffService]:
    s = HandoffService(engine, node_id=node_id, role=role, model_identity=MODEL,
                       cluster=CLUSTER, keyring=keyring(SECRET), address="127.0.0.1:0",
                       silence_s=SILENCE_S, vocab_size=engine.vocab_size, **changes)
    await s.start()
    async with accepting(s.serve, s.aclose):
        yield s


def remote(s: HandoffService) -> RemoteEngine:
    async def resolve() -> str:
        return s.origin

    return RemoteEngine(s.node_id, resolve, keyring=keyring(SECRET), origin=CLIENT_ID,
                        model_identity=MODEL, cluster=CLUSTER, silence_s=SILENCE_S,
                        dial_budget_s=2.0, role=s.role)


@contextlib.asynccontextmanager
async def pair(engine: Any, peers: list[str], *, know_prefill: bool = True,
               **decode_options: Any
               ) -> AsyncIterator[tuple[DisaggEngine, HandoffService, HandoffService]]:
    """A router over one prefill node and one decode node whose prefill peers are
    ``peers`` (the prefill node's origin added when ``know_prefill``)."""
    async with service(engine, "decode-a", "decode", prefill_peers=lambda: peers,
                       **decode_options) as decode, \
            service(engine, "prefill-a", "prefill") as prefill:
        if know_prefill:
            peers.append(prefill.origin)
        members = [remote(prefill), remote(decode)]
        router = DisaggEngine(members[:1], members[1:], model_id=MODEL,
                              context_length=engine.context_length)
        async with linked(router):
            await until(lambda: router.readiness() is None, "both nodes up", WAIT_S)
            yield router, prefill, decode


def test_a_handoff_that_beats_its_expect_is_held_and_decodes(
        node: tuple[LocalEngine, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode node takes each ``expect`` 1 s late: the prefill node's handoff comes
    first, is held, and decodes to the one host's tokens once the expect comes."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPT)

    async def main() -> None:
        local = await tokens(engine, request(ids, 8, temperature=0))
        monkeypatch.setattr(failpoints, "EXPECT_DELAY_S", 1.0)
        async with pair(engine, []) as (router, prefill, decode):
            started = time.monotonic()
            assert await tokens(router, request(ids, 8, temperature=0)) == local
            assert time.monotonic() - started < FIRST_TOKEN_S / 2
            assert decode.stats.held == 1 and decode.stats.dropped == 0
            assert decode.stats.handoffs == prefill.stats.handoffs == 1

    run(main())


def test_a_handoff_whose_expect_never_comes_is_dropped_with_a_log_line(
        node: tuple[LocalEngine, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A peer's handoff for a sequence no router expects is held ``hold_s`` (0.5 s here)
    and then dropped with a ``router_drop`` warning saying so; an ``expect`` for it that
    comes later fails at once (``bad_handoff``), not after the router's bound."""
    engine, tokenizer = node
    sender = "127.0.0.1:19301"  # a prefill peer of the decode node

    async def main() -> None:
        async with service(engine, "decode-a", "decode", prefill_peers=lambda: {sender},
                           early=HeldHandoffs(hold_s=0.5)) as decode:
            peer = await connect_as(sender, decode.origin, keyring=keyring(SECRET),
                                    channel=1, budget_s=WAIT_S)
            try:
                await peer.send(encode_envelope(
                    {"t": "handoff", "seq": "seq-1", "part": 0, "parts": 1,
                     "first": {"token": 1}, "cache": {}}, [("k0", "u8", (4,), bytes(4))]))
                await until(lambda: decode.stats.dropped == 1, "the drop", WAIT_S)
                assert decode.stats.held == 1
                router = remote(decode)
                async with linked(router):
                    await until(lambda: router.state() == "up", "the decode node up", WAIT_S)
                    stream = await router.expect("seq-1", request(tokenizer.encode(PROMPT), 4),
                                                 sender)
                    started = time.monotonic()
                    with pytest.raises(EngineUnavailable, match="the KV cache handoff failed"):
                        async with asyncio.timeout(WAIT_S):
                            await anext(stream)
                    assert time.monotonic() - started < 2.0
            finally:
                await peer.close()
            await until(lambda: decode.sequences == 0, "the sequence freed", WAIT_S)

    with caplog.at_level(logging.WARNING, logger="mlxceld.replicas"):
        run(main())
    assert any("[router_drop]" in r.getMessage() and "held 0.5 s, and no router's expect "
               "for it came" in r.getMessage() for r in caplog.records), caplog.text


def test_a_handoff_from_a_prefill_node_not_known_yet_waits_for_its_agents_answer(
        node: tuple[LocalEngine, Any]) -> None:
    """The decode node does not know the prefill node's address yet (it restarted on a
    new port since the last ask): the handoff is held, the peers are asked again at
    once, and the request decodes; asked once, nothing dropped."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPT)
    asks: list[float] = []
    peers: list[str] = []

    async def main() -> None:
        local = await tokens(engine, request(ids, 8, temperature=0))

        async def recheck() -> None:
            asks.append(time.monotonic())
            await asyncio.sleep(0.2)  # an agent's answer takes a moment
            peers.append(prefill.origin)

        async with pair(engine, peers, know_prefill=False, recheck_peers=recheck) \
                as (router, prefill, decode):
            assert await tokens(router, request(ids, 8, temperature=0)) == local
            assert len(asks) == 1 and decode.stats.held == 1 and decode.stats.dropped == 0

    run(main())


def test_a_handoff_from_a_node_still_not_a_peer_once_asked_fails_the_request_at_once(
        node: tuple[LocalEngine, Any], caplog: pytest.LogCaptureFixture) -> None:
    """The peers' agents, asked again, still do not name the prefill node: the decode
    node ends the sequence at once (``bad_handoff``: 503 with Retry-After), with a
    warning naming why, and frees it; the router does not wait ``FIRST_TOKEN_S``."""
    engine, tokenizer = node
    asks: list[float] = []

    async def recheck() -> None:
        asks.append(time.monotonic())

    async def main() -> None:
        async with pair(engine, [], know_prefill=False, recheck_peers=recheck) \
                as (router, _, decode):
            started = time.monotonic()
            with pytest.raises(EngineUnavailable, match="node decode-a: the KV cache "
                               "handoff failed; retry") as failed:
                await tokens(router, request(tokenizer.encode(PROMPT), 4, temperature=0))
            assert time.monotonic() - started < 5.0 < FIRST_TOKEN_S
            assert failed.value.retry_after_s == 1 and "127.0.0.1" not in str(failed.value)
            assert len(asks) == 1 and decode.stats.dropped == 1
            await until(lambda: decode.sequences == 0, "the sequence freed", WAIT_S)

    with caplog.at_level(logging.WARNING, logger="mlxceld.replicas"):
        run(main())
    assert any("not one of decode node decode-a's prefill peers, as their agents answered "
               "when asked again" in r.getMessage() for r in caplog.records), caplog.text
