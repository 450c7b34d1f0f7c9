"""Prefill/decode disaggregation in one process: a real local engine (the tiny fixture,
loaded once for the module) served by a real prefill node and two real decode nodes
(``HandoffService`` on 127.0.0.1), a router's ``DisaggEngine`` over ``RemoteEngine``s
with real keys, and test-side MXCL clients holding the secret for what a forger (or a
prefill peer gone wrong) sends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxceld.engine import EngineError, EngineUnavailable, GenerationRequest
from mlxceld.engine.handoff import HandoffUnsupported, Mode
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.net import connect_as
from mlxceld.replicas import disagg
from mlxceld.replicas.disagg import DisaggEngine, DisaggOrReplicas
from mlxceld.replicas.handoffs import HandoffService, decode_allowlist, handoff_bytes
from mlxceld.replicas.messages import first_field
from mlxceld.replicas.pool import ReplicaEngine
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.replicas.service import ServingService
from mlxceld.wire import encode_envelope
from mlxceld.wire.messages import MessageError

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, SECRET, accepting, run
from helpers.replicas import linked, request, tokens
from helpers.waiting import until

MODEL = "ab" * 32
CLUSTER = "disagg-test"
SILENCE_S = 5.0
WAIT_S = 10.0  # generous: a loaded machine; no assertion here is about time
PROMPTS = ["Hello, world", "The quick brown fox jumps over", "x", "Once upon a time"]


@pytest.fixture(scope="module")
def node(fixture_dir: Path) -> Iterator[tuple[LocalEngine, Any]]:
    engine, tokenizer = load_local_engine(str(fixture_dir / "qwen3"), max_batch=4)
    yield engine, tokenizer
    asyncio.run(engine.aclose())


class Refusing:
    """The engine, but its ``prefill`` refuses as a sliding-window family's would while
    ``refuse`` is set (a fake of our own seam: the real refusal is engine/handoff.py's)."""

    def __init__(self, engine: LocalEngine) -> None:
        self._engine = engine
        self.refuse = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def prefill(self, request: GenerationRequest) -> Any:
        if self.refuse:
            raise HandoffUnsupported("gemma3: its sliding-window layers keep a "
                                     "RotatingKVCache, which cannot be handed off; serve it "
                                     "on hybrid nodes")
        return await self._engine.prefill(request)


@contextlib.asynccontextmanager
async def node_service(engine: Any, node_id: str, role: str,
                       **changes: Any) -> AsyncIterator[HandoffService]:
    options: dict[str, Any] = dict(node_id=node_id, role=role, model_identity=MODEL,
                                   cluster=CLUSTER, keyring=keyring(SECRET),
                                   address="127.0.0.1:0", silence_s=SILENCE_S,
                                   vocab_size=engine.vocab_size)
    service = HandoffService(engine, **{**options, **changes})
    await service.start()
    async with accepting(service.serve, service.aclose):
        yield service


def remote(service: ServingService) -> RemoteEngine:
    async def resolve() -> str:
        return f"{service.host}:{service.port}"

    return RemoteEngine(service.node_id, resolve, keyring=keyring(SECRET), origin=CLIENT_ID,
                        model_identity=MODEL, cluster=CLUSTER, silence_s=SILENCE_S,
                        dial_budget_s=2.0, role=service.role)


@contextlib.asynccontextmanager
async def cluster(engine: Any, *, prefill_engine: Any = None, allowlist: bool = True,
                  mode: Mode | None = None, peers: bool = True
                  ) -> AsyncIterator[tuple[DisaggEngine, HandoffService,
                                           list[HandoffService]]]:
    """1 prefill node, 2 decode nodes, and a router's engine over them, all linked."""
    async with contextlib.AsyncExitStack() as stack:
        decodes = []
        prefill_origin: list[str] = []
        for name in ("decode-a", "decode-b"):
            decodes.append(await stack.enter_async_context(node_service(
                engine, name, "decode", prefill_peers=lambda: prefill_origin)))
        allowed = frozenset(d.origin for d in decodes) if allowlist else None
        prefill = await stack.enter_async_context(node_service(
            prefill_engine or engine, "prefill-a", "prefill", allowlist=allowed))
        if peers:
            prefill_origin.append(prefill.origin)
        members = [remote(prefill), *(remote(d) for d in decodes)]
        router = DisaggEngine(members[:1], members[1:], model_id=MODEL,
                              context_length=engine.context_length, mode=mode)
        async with linked(router):
            await until(lambda: router.readiness() is None and all(
                m.state() == "up" for m in members), "every node up", WAIT_S)
            yield router, prefill, decodes


def test_greedy_tokens_equal_one_hosts_and_both_decode_nodes_serve(
        node: tuple[LocalEngine, Any]) -> None:
    """Uncompressed: every token (with its log-probabilities) is the one host's, 4 at
    once spread over both decode nodes; int8 keeps the greedy tokens on this fixture,
    int4+lz4 its first token (sampled on the prefill node from the exact cache) and 16
    in-vocabulary tokens, in fewer bytes than int8 (engine/handoff.py's tests bound their
    logits). Stats: bytes per handoff, addresses only when verbose."""
    engine, tokenizer = node
    prompts = [tokenizer.encode(text) for text in PROMPTS]

    async def main() -> None:
        local = [await tokens(engine, request(ids, 16, temperature=0, logprobs=2))
                 for ids in prompts]
        async with cluster(engine) as (router, prefill, decodes):
            together = await asyncio.gather(*(tokens(router, request(
                ids, 16, temperature=0, logprobs=2)) for ids in prompts))
            assert list(together) == local
            stats = router.stats(verbose=False)
            by_id = {n["id"]: n for n in stats["nodes"]}
            assert by_id["decode-a"]["completed"] >= 1 and by_id["decode-b"]["completed"] >= 1
            assert by_id["prefill-a"]["handoff"]["handoffs"] == 4
            assert stats["handoff"]["bytes"] == prefill.stats.bytes > 0
            assert sum(d.stats.handoffs for d in decodes) == 4
            assert "127.0.0.1" not in repr(stats) and stats["addresses_redacted"]
            assert router.stats(verbose=True)["nodes"][0]["address"] == prefill.origin
            assert router.active_sequences() == 0 and engine.active_sequences() == 0
            sizes = {}
            for mode in (Mode("int8"), Mode("int4", lz4=True)):
                router.mode = mode
                before = prefill.stats.bytes
                lossy = [await tokens(router, request(ids, 16, temperature=0))
                         for ids in prompts[:2]]
                greedy = [[o.token for o in out] for out in local[:2]]
                got = [[o.token for o in out] for out in lossy]
                if mode.quant == "int8":
                    assert got == greedy
                else:  # the first token is the prefill node's, the rest are sane
                    assert [g[0] for g in got] == [g[0] for g in greedy]
                    assert all(len(g) == 16 and all(0 <= t < engine.vocab_size for t in g)
                               for g in got)
                assert router.stats(verbose=False)["kv_compression"] == str(mode)
                sizes[str(mode)] = prefill.stats.bytes - before
            uncompressed = stats["handoff"]["bytes"] * sum(map(len, prompts[:2])) \
                // sum(map(len, prompts))
            assert sizes["int4+lz4"] < sizes["int8"] < uncompressed

    run(main())


def test_a_decode_target_outside_the_allowlist_is_refused_before_any_work(
        node: tuple[LocalEngine, Any]) -> None:
    """A secret holder's ``prefill`` naming a target the allowlist lacks: ``forbidden``,
    nothing prefilled, nothing dialed; the node serves on."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[1])

    async def main() -> None:
        async with cluster(engine) as (router, prefill, decodes):
            forger = remote(prefill)
            async with linked(forger):
                await until(lambda: forger.state() == "up", "the forger attached", WAIT_S)
                with pytest.raises(EngineError, match="MLXCEL_DECODE_ALLOWLIST"):
                    await forger.prefill("forged-1", request(ids, 4, temperature=0),
                                         decode_target="127.0.0.1:9", compression="none",
                                         within_s=WAIT_S)
            assert prefill.stats.refused == 1 and prefill.stats.handoffs == 0
            assert sum(d.stats.dropped + d.stats.handoffs for d in decodes) == 0
            assert len(await tokens(router, request(ids, 4, temperature=0))) == 4

    run(main())


def test_a_handoff_from_a_non_peer_is_dropped_and_the_real_one_decodes(
        node: tuple[LocalEngine, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A secret holder that is not a configured prefill peer sends a ``handoff`` for a seq
    the router expects: dropped with a ``router_drop`` warning, and the real handoff for
    that seq then decodes to the one host's tokens."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[3])

    async def main() -> None:
        local = await tokens(engine, request(ids, 8, temperature=0))
        async with cluster(engine) as (router, prefill, decodes):
            prefill_link, decode_link = router._prefill["prefill-a"], router._decode["decode-a"]
            stream = await decode_link.expect("seq-1", request(ids, 8, temperature=0),
                                              prefill.origin)
            forger = await connect_as(CLIENT_ID, decodes[0].origin, keyring=keyring(SECRET),
                                      channel=1, budget_s=WAIT_S)
            try:
                await forger.send(encode_envelope(
                    {"t": "handoff", "seq": "seq-1", "part": 0, "parts": 1,
                     "first": {"token": 1}, "cache": {}},
                    [("k0", "u8", (4,), b"\0\0\0\0")]))
                await until(lambda: decodes[0].stats.dropped == 1, "the drop", WAIT_S)
            finally:
                await forger.close()
            await prefill_link.prefill("seq-1", request(ids, 8, temperature=0),
                                       decode_target=decodes[0].origin, compression="none",
                                       within_s=WAIT_S)
            got = [out async for out in stream]
            assert got == local
        assert any("[router_drop]" in r.getMessage() and "not one of this node's prefill "
                   "peers" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="mlxceld.replicas.handoffs"):
        run(main())


def test_a_family_that_cannot_hand_off_is_refused_per_request(
        node: tuple[LocalEngine, Any]) -> None:
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[0])
    refusing = Refusing(engine)

    async def main() -> None:
        async with cluster(engine, prefill_engine=refusing) as (router, _, decodes):
            with pytest.raises(HandoffUnsupported, match=r"gemma3: .*serve it on hybrid"):
                await tokens(router, request(ids, 4, temperature=0))
            await until(lambda: sum(d.sequences for d in decodes) == 0,
                        "the decode node frees the expected sequence", WAIT_S)
            assert router.readiness() is None  # every node serves on
            refusing.refuse = False
            assert len(await tokens(router, request(ids, 4, temperature=0))) == 4

    run(main())


def test_no_pair_is_503_and_the_allowlist_skips_names(
        node: tuple[LocalEngine, Any], caplog: pytest.LogCaptureFixture) -> None:
    engine, _ = node

    async def main() -> None:
        async with cluster(engine) as (router, _, decodes):
            for d in decodes:
                await d.aclose()
            await until(lambda: router.readiness() is not None, "decode nodes down", WAIT_S)
            with pytest.raises(EngineUnavailable, match="no decode node is up") as down:
                await tokens(router, request([1, 2, 3], 4))
            assert down.value.retry_after_s >= 1
            assert "127.0.0.1" not in str(down.value)

    run(main())
    with caplog.at_level(logging.WARNING, logger="mlxceld.replicas.handoffs"):
        assert decode_allowlist("10.0.0.2:7000, decode.example:7000, junk,") == \
            frozenset({"10.0.0.2:7000"})
        assert decode_allowlist("") is None
    text = caplog.text
    assert "decode.example:7000" in text and "'junk'" in text and "is not set" in text


def test_with_replicas_too_a_request_goes_to_them_without_a_pair(
        node: tuple[LocalEngine, Any]) -> None:
    """Both pools and a replica (a hybrid node): disaggregated while a pair is up, to the
    replica when the family cannot hand off or no decode node is up."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[2])
    refusing = Refusing(engine)
    refusing.refuse = False

    async def main() -> None:
        local = await tokens(engine, request(ids, 6, temperature=0))
        hybrid = ServingService(engine, node_id="hybrid-a", role="hybrid",
                                model_identity=MODEL, cluster=CLUSTER, keyring=keyring(SECRET),
                                address="127.0.0.1:0", silence_s=SILENCE_S)
        await hybrid.start()
        async with cluster(engine, prefill_engine=refusing) as (router, _, decodes), \
                accepting(hybrid.serve, hybrid.aclose):
            replica = remote(hybrid)
            pool = ReplicaEngine([replica], model_id=MODEL,
                                 context_length=engine.context_length)
            both = DisaggOrReplicas(router, pool)
            async with linked(pool):
                await until(lambda: replica.state() == "up", "the replica up", WAIT_S)
                assert await tokens(both, request(ids, 6, temperature=0)) == local
                assert router.stats(verbose=False)["handoff"]["handoffs"] == 1
                refusing.refuse = True
                assert await tokens(both, request(ids, 6, temperature=0)) == local
                assert pool.stats(verbose=False)["completed"] == 1
                for d in decodes:
                    await d.aclose()
                await until(lambda: router.readiness() is not None, "decode down", WAIT_S)
                assert both.readiness() is None
                assert await tokens(both, request(ids, 6, temperature=0)) == local
                assert pool.stats(verbose=False)["completed"] == 2

    run(main())


@pytest.mark.parametrize("refusing", ["prefill", "decode"])
def test_a_pair_that_refuses_before_the_first_token_falls_back_to_a_replica(
        node: tuple[LocalEngine, Any], refusing: str) -> None:
    """Both pools up and a replica: a pair whose node refuses the request before its first
    token (it is draining: ``EngineUnavailable``) does not fail it; the replica answers
    it, with the one host's tokens."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[1])

    async def main() -> None:
        local = await tokens(engine, request(ids, 6, temperature=0))
        hybrid = ServingService(engine, node_id="hybrid-a", role="hybrid",
                                model_identity=MODEL, cluster=CLUSTER, keyring=keyring(SECRET),
                                address="127.0.0.1:0", silence_s=SILENCE_S)
        await hybrid.start()
        async with cluster(engine) as (router, prefill, decodes), \
                accepting(hybrid.serve, hybrid.aclose):
            replica = remote(hybrid)
            pool = ReplicaEngine([replica], model_id=MODEL,
                                 context_length=engine.context_length)
            both = DisaggOrReplicas(router, pool)
            async with linked(pool):
                await until(lambda: replica.state() == "up", "the replica up", WAIT_S)
                for n in [prefill] if refusing == "prefill" else decodes:
                    assert await n.finish_held(0.0) == 0
                assert router.readiness() is None  # the pair is up: it is tried first
                assert await tokens(both, request(ids, 6, temperature=0)) == local
                assert pool.stats(verbose=False)["completed"] == 1
                tried = [n for n in router.stats(verbose=False)["nodes"]
                         if n["role"] == refusing]
                # each draining node refused it once (a refusal before the first token is
                # tried on another pair without that node): the one prefill node, or
                # both decode nodes
                assert sum(n["failed"] for n in tried) == len(tried)

    run(main())


def test_a_prefill_node_the_decode_node_does_not_list_fails_the_request_at_once(
        node: tuple[LocalEngine, Any]) -> None:
    """A decode node whose prefill peers lack the prefill node (and that has no agents to
    ask again) drops its handoff and ends the sequence at once: the router fails the
    request with 503 naming the decode node, well before ``FIRST_TOKEN_S`` (before:
    after it, with a hint that guessed), and the decode node frees the sequence."""
    engine, tokenizer = node

    async def main() -> None:
        async with cluster(engine, peers=False) as (router, _, decodes):
            started = asyncio.get_running_loop().time()
            with pytest.raises(EngineUnavailable, match=r"node decode-\w: the KV cache "
                               r"handoff failed; retry") as failed:
                await tokens(router, request(tokenizer.encode(PROMPTS[0]), 4, temperature=0))
            assert asyncio.get_running_loop().time() - started < disagg.FIRST_TOKEN_S / 4
            assert "127.0.0.1" not in str(failed.value)
            assert sum(d.stats.dropped for d in decodes) == 1
            await until(lambda: sum(d.sequences for d in decodes) == 0,
                        "the decode node frees the expected sequence", WAIT_S)

    run(main())


@pytest.mark.parametrize("cached", [-1, True, 1.5, "3", 2**40])
def test_a_handoffs_first_token_with_a_bad_cached_count_is_refused(cached: object) -> None:
    """``first.cached`` (the prefill node's prompt-cache count) is an integer in bounds, or
    the handoff is refused naming it; a good one comes out on the first token."""
    assert first_field({"token": 3, "cached": 7}).cached == 7
    with pytest.raises(MessageError, match=r"first\.cached"):
        first_field({"token": 3, "cached": cached})


def test_a_handoff_whose_blobs_add_up_past_the_bound_is_refused_at_once(
        node: tuple[LocalEngine, Any], caplog: pytest.LogCaptureFixture) -> None:
    """The frames' blobs may not add up to more than the expected prompt's cache takes
    (``handoff_bytes``): two blobs each just over half of it, in the first part of two,
    end the sequence with ``bad_handoff`` at once, naming the bound; the decode node does
    not wait for the second part (its ``handoff_timeout_s`` is far off)."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[2])
    limit = handoff_bytes(engine.cache_layout(), len(ids))
    blob = bytes(limit // 2 + 1)  # each under the bound, the two together over it
    sender = "127.0.0.1:19201"  # a prefill peer of the decode node, as the router says

    async def main() -> None:
        async with node_service(engine, "decode-a", "decode", prefill_peers=lambda: {sender},
                                handoff_timeout_s=300.0) as decode:
            router = remote(decode)
            async with linked(router):
                await until(lambda: router.state() == "up", "the decode node up", WAIT_S)
                stream = await router.expect("seq-1", request(ids, 4, temperature=0), sender)
                prefill = await connect_as(sender, decode.origin, keyring=keyring(SECRET),
                                           channel=1, budget_s=WAIT_S)
                try:
                    await prefill.send(encode_envelope(
                        {"t": "handoff", "seq": "seq-1", "part": 0, "parts": 2,
                         "first": {"token": 1}, "cache": {}},
                        [(name, "u8", (len(blob),), blob) for name in ("k0", "v0")]))
                    with pytest.raises(EngineUnavailable, match="the KV cache handoff failed"):
                        async with asyncio.timeout(WAIT_S):
                            await anext(stream)
                finally:
                    await stream.aclose()
                    await prefill.close()
            await until(lambda: decode.sequences == 0, "the sequence freed", WAIT_S)
            assert decode.stats.dropped == decode.stats.handoffs == 0

    with caplog.at_level(logging.WARNING):
        run(main())
    assert any(f"the handoff exceeds {limit} bytes" in r.getMessage()
               for r in caplog.records), caplog.text
