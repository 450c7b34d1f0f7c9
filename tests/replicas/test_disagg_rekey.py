"""A secret rotation's ``use`` under a disaggregated sequence, in one process: a real local
engine (the tiny fixture) served by a real prefill node and a real decode node
(``HandoffService`` on 127.0.0.1), a router's ``DisaggEngine`` over ``RemoteEngine``s,
every party's keyring holding the old and the new secret. The primary changes while a
long sequence decodes: the router's links move it to the new key (``adopt``), the
prefill node's idle link to the decode node is finished (``targets.py``), so no stream
is left under the old key while the sequence still runs; its tokens are the engine's
own, and a request after it hands its cache off over a link under the new key."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.net import streams_under
from mlxceld.replicas.disagg import DisaggEngine
from mlxceld.replicas.handoffs import HandoffService
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.wire import Keyring, key_id

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, accepting, run
from helpers.replicas import linked, request, tokens
from helpers.waiting import until

MODEL = "ab" * 32
CLUSTER = "disagg-rekey-test"
SILENCE_S = 5.0
WAIT_S = 10.0  # generous: a loaded machine; no assertion here is about time
NEW_SECRET = b"the rotation's new cluster secret, 40 b."


@pytest.fixture(scope="module")
def node(fixture_dir: Path) -> Iterator[tuple[LocalEngine, Any]]:
    engine, tokenizer = load_local_engine(str(fixture_dir / "qwen3"), max_batch=4)
    yield engine, tokenizer
    asyncio.run(engine.aclose())


@contextlib.asynccontextmanager
async def node_service(engine: Any, node_id: str, role: str, ring: Keyring,
                       **extra: Any) -> AsyncIterator[HandoffService]:
    service = HandoffService(engine, node_id=node_id, role=role, model_identity=MODEL,
                             cluster=CLUSTER, keyring=ring, address="127.0.0.1:0",
                             silence_s=SILENCE_S, vocab_size=engine.vocab_size, **extra)
    await service.start()
    async with accepting(service.serve, service.aclose):
        yield service


def remote(service: HandoffService, ring: Keyring) -> RemoteEngine:
    async def resolve() -> str:
        return f"{service.host}:{service.port}"

    return RemoteEngine(service.node_id, resolve, keyring=ring, origin=CLIENT_ID,
                        model_identity=MODEL, cluster=CLUSTER, silence_s=SILENCE_S,
                        dial_budget_s=2.0, role=service.role)


def test_a_decoding_sequence_and_the_handoff_link_move_to_the_new_key(
        node: tuple[LocalEngine, Any]) -> None:
    engine, tokenizer = node
    ids = tokenizer.encode("Once upon a time")
    endless = {"temperature": 0, "logit_bias": tuple(
        (t, -100.0) for t in sorted(tokenizer.eos_token_ids))}
    rings = {name: keyring(SECRET, NEW_SECRET) for name in ("router", "prefill", "decode")}
    got: list[int] = []

    async def main() -> None:
        async with node_service(engine, "decode-a", "decode", rings["decode"],
                                prefill_peers=lambda: peers) as decode, \
                node_service(engine, "prefill-a", "prefill", rings["prefill"]) as prefill:
            peers.append(prefill.origin)
            members = [remote(prefill, rings["router"]), remote(decode, rings["router"])]
            router = DisaggEngine(members[:1], members[1:], model_id=MODEL,
                                  context_length=engine.context_length)
            async with linked(router):
                await until(lambda: router.readiness() is None, "both nodes up", WAIT_S)
                held = router.generate(request(ids, 5000, **endless))
                got.extend([(await anext(held)).token for _ in range(3)])
                assert streams_under(key_id(SECRET)) == 6  # 3 links, both ends each
                for ring in rings.values():
                    ring.add(NEW_SECRET, primary=True)
                router.rekey()
                prefill.rekey()  # the worker's keyring op calls it (handoff_node.py)
                await until(lambda: streams_under(key_id(SECRET)) == 0,
                            "no stream left under the old key while the sequence runs",
                            WAIT_S)
                assert decode.sequences == 1
                assert len(await tokens(router, request(ids, 4, temperature=0))) == 4
                assert prefill.stats.handoffs == 2
                assert streams_under(key_id(SECRET)) == 0
                for _ in range(40):
                    got.append((await anext(held)).token)
                await held.aclose()
                await until(lambda: decode.sequences == 0, "the decode node freed it",
                            WAIT_S)

    peers: list[str] = []
    run(main())
    local = [out.token for out in run(tokens(engine, request(ids, len(got), **endless)))]
    assert got == local
