"""The replica wire end to end in one process: a real local engine (the tiny fixture, loaded
once for the module) behind a real ``ServingService`` on 127.0.0.1, and a ``RemoteEngine``
dialing it with real keys. A node that stops answering is a listener of our own that
attaches and then reads nothing (no pong: what a SIGSTOPped host looks like)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxceld.engine import EngineUnavailable, SamplingParams
from mlxceld.engine.base import Constraint
from mlxceld.engine.loading import load_local_engine
from mlxceld.engine.local import LocalEngine
from mlxceld.net import MxclStream, connect, streams_under
from mlxceld.pipeline.protocol import params_to_wire
from mlxceld.replicas import protocol as p
from mlxceld.replicas.answers import RequestRefused
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.replicas.service import ServingService
from mlxceld.wire import encode_envelope, key_id, parse_envelope

from helpers.keys import keyring
from helpers.mxcl import CLIENT_ID, OTHER_SECRET, SECRET, accepting, run
from helpers.mxcl import serving as mxcl_serving
from helpers.replicas import linked as kept_linked
from helpers.replicas import request, tokens
from helpers.waiting import until

MODEL = "ab" * 32  # the model identity both sides name
CLUSTER = "replicas-test"
SILENCE_S = 0.6
WAIT_S = 10.0  # generous: a loaded machine; no assertion here is about time but silence's
PROMPTS = ["Hello, world", "The quick brown fox jumps over", "x", "Once upon a time"]


@pytest.fixture(scope="module")
def node(fixture_dir: Path) -> Iterator[tuple[LocalEngine, Any]]:
    engine, tokenizer = load_local_engine(str(fixture_dir / "qwen3"), max_batch=4)
    yield engine, tokenizer
    asyncio.run(engine.aclose())


@contextlib.asynccontextmanager
async def serving(engine: Any, **changes: Any) -> AsyncIterator[ServingService]:
    options: dict[str, Any] = dict(node_id="node-a", role="hybrid", model_identity=MODEL,
                                   cluster=CLUSTER, keyring=keyring(SECRET),
                                   address="127.0.0.1:0", silence_s=SILENCE_S,
                                   vocab_size=engine.vocab_size)
    service = ServingService(engine, **{**options, **changes})
    async with accepting(service.serve, service.aclose):
        yield service


@contextlib.asynccontextmanager
async def remote_to(port: int, *, up: bool = True, **changes: Any
                    ) -> AsyncIterator[RemoteEngine]:
    async def resolve() -> str:
        return f"127.0.0.1:{port}"

    options: dict[str, Any] = dict(keyring=keyring(SECRET), origin=CLIENT_ID,
                                   model_identity=MODEL, cluster=CLUSTER, silence_s=SILENCE_S,
                                   dial_budget_s=1.0)
    remote = RemoteEngine("node-a", resolve, **{**options, **changes})
    async with kept_linked(remote):
        await until(lambda: remote.state() != "connecting", "the first attempt", WAIT_S)
        if up:
            assert remote.state() == "up", remote.last_error()
        yield remote


def endless(tokenizer: Any) -> dict[str, Any]:
    """Greedy parameters under which the fixture never stops by itself (eos ruled out)."""
    return {"temperature": 0, "logit_bias": tuple((t, -100.0)
                                                  for t in sorted(tokenizer.eos_token_ids))}


def test_remote_tokens_equal_the_engines_own(node: tuple[LocalEngine, Any]) -> None:
    """Greedy output (with log-probabilities) over the wire is the engine's own, one at a
    time and 4 at once; the node's context and batch come with ``attached``."""
    engine, tokenizer = node
    prompts = [tokenizer.encode(text) for text in PROMPTS]

    async def main() -> None:
        local = [await tokens(engine, request(ids, 24, temperature=0, logprobs=2))
                 for ids in prompts]
        async with serving(engine) as service, remote_to(service.port) as remote:
            assert (remote.context_length, remote.max_batch) == (engine.context_length, 4)
            alone = [await tokens(remote, request(ids, 24, temperature=0, logprobs=2))
                     for ids in prompts]
            together = await asyncio.gather(*(tokens(remote, request(ids, 24, temperature=0,
                                                                     logprobs=2))
                                              for ids in prompts))
            assert remote.active_sequences() == 0
        assert alone == local
        assert list(together) == local
        assert any(out.finish_reason == "length" for out in local[0])
        # The node's prompt cache held each prompt (asked locally first); the count of its
        # tokens it gave comes over the wire on the first output (usage's cached_tokens).
        said = [outs[0].cached for outs in alone]
        assert None not in said and any(n > 0 for n in said if n is not None), said

    run(main())


def test_cancel_and_a_dropped_router_free_the_nodes_sequences(
        node: tuple[LocalEngine, Any]) -> None:
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[1])

    async def main() -> None:
        async with serving(engine) as service:
            async with remote_to(service.port) as remote:
                stream = remote.generate(request(ids, 5000, **endless(tokenizer)))
                for _ in range(3):
                    await anext(stream)
                assert engine.active_sequences() == 1 and service.sequences == 1
                await until(lambda: remote.node_sequences == 1, "the node's load", WAIT_S)
                await stream.aclose()  # sends cancel
                await until(lambda: engine.active_sequences() == 0 and service.sequences == 0,
                            "the node frees the cancelled sequence", WAIT_S)
                stream = remote.generate(request(ids, 5000, **endless(tokenizer)))
                await anext(stream)
                assert service.sequences == 1
            # The router is gone (its link closed, its generator never closed): freed too.
            await until(lambda: engine.active_sequences() == 0 and service.sequences == 0,
                        "the node frees a gone router's sequence", WAIT_S)
            with contextlib.suppress(Exception):
                await stream.aclose()

    run(main())


def test_wrong_secret_and_wrong_model_are_refused_and_named(
        node: tuple[LocalEngine, Any]) -> None:
    engine, _ = node

    async def main() -> None:
        async with serving(engine) as service:
            async with remote_to(service.port, up=False, keyring=keyring(OTHER_SECRET)) as remote:
                assert remote.state() == "down"
                error = remote.last_error() or ""
                assert "node node-a refused the handshake" in error, error
                assert "cluster secret" in error
                assert OTHER_SECRET.decode() not in error and "127.0.0.1" not in error
                with pytest.raises(EngineUnavailable, match="node node-a"):
                    await tokens(remote, request([1, 2], 2))
            async with remote_to(service.port, up=False, model_identity="cd" * 32) as remote:
                assert remote.state() == "down"
                error = remote.last_error() or ""
                assert "node node-a refused to attach (model_mismatch)" in error, error
                assert MODEL in error and "cd" * 32 in error
            async with remote_to(service.port, up=False, cluster="another") as remote:
                assert "(cluster_mismatch)" in (remote.last_error() or "")
            assert service.sequences == 0

    run(main())


def test_busy_and_bad_request_reach_the_caller(node: tuple[LocalEngine, Any]) -> None:
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[0])

    async def main() -> None:
        async with serving(engine, max_sequences=1) as service, \
                remote_to(service.port) as remote:
            held = remote.generate(request(ids, 5000, **endless(tokenizer)))
            await anext(held)
            with pytest.raises(EngineUnavailable, match="node node-a is busy") as busy:
                await tokens(remote, request(ids, 4, temperature=0))
            assert busy.value.retry_after_s >= 1
            await held.aclose()
            await until(lambda: service.sequences == 0, "the held sequence ends", WAIT_S)
            bad = request(ids, 4, constraint=Constraint("lark", "this is not a grammar"))
            with pytest.raises(RequestRefused, match=r"node node-a: .*grammar"):
                await tokens(remote, bad)
            too_long = request([1] * (engine.context_length + 1), 4)
            with pytest.raises(RequestRefused, match="context"):
                await tokens(remote, too_long)
            with pytest.raises(RequestRefused, match=r"token ids must be in \[0, "):
                await tokens(remote, request([1, engine.vocab_size], 4))
            # and the link is still up, serving
            assert remote.state() == "up"
            assert len(await tokens(remote, request(ids, 3, temperature=0))) == 3

    run(main())


async def _attached_then_silent(stream: MxclStream) -> None:
    """A node that attaches, then reads nothing more: no pong, no token (SIGSTOP-like)."""
    env = parse_envelope(await stream.recv(), p.NODE_SPECS)
    assert env.type == "attach"
    await stream.send(encode_envelope({"t": "attached", "node": "node-a", "role": "hybrid",
                                       "model": MODEL, "context_length": 64, "max_batch": 2}))
    await asyncio.sleep(3600)


def test_a_silent_node_is_down_and_its_sequence_ends() -> None:
    async def main() -> None:
        async with mxcl_serving(_attached_then_silent, channels={1}) as listener, \
                remote_to(listener.port) as remote:
            begun = time.monotonic()
            with pytest.raises(EngineUnavailable, match="node node-a is silent"):
                await tokens(remote, request([1, 2, 3], 4))
            took = time.monotonic() - begun
            assert remote.state() == "down"
            assert "silent" in (remote.last_error() or "")
            assert took < SILENCE_S + 3.0, took  # about silence_s, never a hang

    run(main())


def test_a_sequence_belongs_to_its_connection(node: tuple[LocalEngine, Any]) -> None:
    """A ``cancel`` from another connection is ignored, and a sequence's tokens go only
    to the connection that sent it: the result-frame rule, on the node's side."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[3])
    prompt = [("prompt", "i32", (1, len(ids)), struct.pack(f"<{len(ids)}i", *ids))]
    attach = encode_envelope({"t": "attach", "model": MODEL, "cluster": CLUSTER})

    async def dial() -> MxclStream:
        stream = await connect("127.0.0.1", port, keyring=keyring(SECRET), identity=CLIENT_ID,
                               channel=1, local_addr=("127.0.0.1", 0))
        await stream.send(attach)
        assert parse_envelope(await stream.recv(), p.ROUTER_SPECS).type == "attached"
        return stream

    async def answer(stream: MxclStream) -> Any:
        """The next message but ``load`` (which the node sends on its own)."""
        while (env := parse_envelope(await stream.recv(), p.ROUTER_SPECS)).type == "load":
            pass
        return env

    async def main() -> None:
        nonlocal port
        async with serving(engine) as service:
            port = service.port
            a, b = await dial(), await dial()
            try:
                params = params_to_wire(SamplingParams(max_tokens=20, temperature=0))
                await a.send(encode_envelope({"t": "generate", "seq": "s1",
                                              "params": params}, prompt))
                await b.send(encode_envelope({"t": "cancel", "seq": "s1"}))
                got = []
                while True:
                    env = await answer(a)
                    assert env.type == "token" and env.header["seq"] == "s1", env.header
                    got.append(env)
                    if "finish_reason" in env.header:
                        break
                assert len(got) == 20 or got[-1].header["finish_reason"] == "stop"
                # b got nothing for s1: its next message is the answer to its own request
                await b.send(encode_envelope({"t": "generate", "seq": "s1",
                                              "params": {"bad": 1}}, prompt))
                env = await answer(b)
                assert (env.type, env.header["code"], env.header["seq"]) == (
                    "error", p.ERR_BAD_MESSAGE, "s1")
                assert service.sequences == 0
            finally:
                await a.close()
                await b.close()

    port = 0
    run(main())


NEW_SECRET = b"the rotation's new cluster secret, 40 b."


def test_rekey_moves_a_running_sequence_to_the_new_key(node: tuple[LocalEngine, Any]) -> None:
    """A secret rotation's ``use``: the link attaches a stream under the new primary for new
    sequences, and the one running moves there (``adopt``): the old key's streams (ours
    and the node's) are finished while it still runs, and its tokens are the engine's
    own greedy ones, none lost, repeated or out of order."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[2])
    ring = keyring(SECRET)
    got: list[int] = []

    async def main() -> None:
        async with serving(engine, keyring=keyring(SECRET, NEW_SECRET)) as service, \
                remote_to(service.port, keyring=ring) as remote:
            held = remote.generate(request(ids, 5000, **endless(tokenizer)))
            got.extend([(await anext(held)).token for _ in range(3)])
            ring.add(NEW_SECRET, primary=True)
            remote.rekey()
            await until(lambda: streams_under(key_id(SECRET)) == 0,
                        "the old key's streams finished while the sequence runs", WAIT_S)
            assert streams_under(key_id(NEW_SECRET)) == 2  # ours and the node's
            assert service.sequences == 1  # still running, on the new stream
            assert len(await tokens(remote, request(ids, 3, temperature=0))) == 3
            for _ in range(40):
                got.append((await anext(held)).token)
            await held.aclose()
            await until(lambda: service.sequences == 0, "the node freed it", WAIT_S)
            assert remote.state() == "up" and remote.active_sequences() == 0

    run(main())
    local = [out.token for out in run(tokens(engine, request(ids, len(got),
                                                             **endless(tokenizer))))]
    assert got == local


def test_a_sequence_is_adopted_only_by_its_own_routers_other_connection(
        node: tuple[LocalEngine, Any]) -> None:
    """The node's side of ``adopt``: from another router's connection it changes nothing
    (the tokens go on over the first); from another connection of the same router,
    ``adopted`` comes over the first after every token sent there, and the rest over the
    second: together the engine's greedy tokens, in order; a ``cancel`` over the first
    is ignored then, over the second it ends the sequence."""
    engine, tokenizer = node
    ids = tokenizer.encode(PROMPTS[3])
    prompt = [("prompt", "i32", (1, len(ids)), struct.pack(f"<{len(ids)}i", *ids))]
    attach = encode_envelope({"t": "attach", "model": MODEL, "cluster": CLUSTER})
    params = params_to_wire(SamplingParams(max_tokens=5000, **endless(tokenizer)))
    got: list[int] = []

    async def dial(identity: str) -> MxclStream:
        stream = await connect("127.0.0.1", port, keyring=keyring(SECRET), identity=identity,
                               channel=1, local_addr=("127.0.0.1", 0))
        await stream.send(attach)
        assert parse_envelope(await stream.recv(), p.ROUTER_SPECS).type == "attached"
        return stream

    async def answer(stream: MxclStream) -> Any:
        """The next message but ``load`` (which the node sends on its own)."""
        while (env := parse_envelope(await stream.recv(), p.ROUTER_SPECS)).type == "load":
            pass
        return env

    async def main() -> None:
        nonlocal port
        async with serving(engine) as service:
            port = service.port
            a, other, b = (await dial(CLIENT_ID), await dial("127.0.0.1:19101"),
                           await dial(CLIENT_ID))
            try:
                await a.send(encode_envelope({"t": "generate", "seq": "s1",
                                              "params": params}, prompt))
                got.append(struct.unpack("<i", (await answer(a)).tensors["tokens"].data)[0])
                await other.send(encode_envelope({"t": "adopt", "seq": "s1"}))
                for _ in range(3):  # still over a: the other router's adopt changed nothing
                    env = await answer(a)
                    assert env.type == "token", env.header
                    got.append(struct.unpack("<i", env.tensors["tokens"].data)[0])
                await b.send(encode_envelope({"t": "adopt", "seq": "s1"}))
                while (env := await answer(a)).type == "token":
                    got.append(struct.unpack("<i", env.tensors["tokens"].data)[0])
                assert (env.type, env.header["seq"]) == ("adopted", "s1"), env.header
                await a.send(encode_envelope({"t": "cancel", "seq": "s1"}))  # not a's now
                for _ in range(20):
                    env = await answer(b)
                    assert env.type == "token" and env.header["seq"] == "s1", env.header
                    got.append(struct.unpack("<i", env.tensors["tokens"].data)[0])
                assert service.sequences == 1
                await b.send(encode_envelope({"t": "cancel", "seq": "s1"}))
                await until(lambda: service.sequences == 0, "b's cancel ended it", WAIT_S)
            finally:
                for stream in (a, other, b):
                    await stream.close()

    port = 0
    run(main())
    local = [out.token for out in run(tokens(engine, request(ids, len(got),
                                                             **endless(tokenizer))))]
    assert got == local


def test_tokens_are_taken_only_from_the_connection_the_sequence_went_over() -> None:
    """The result-frame rule on the router's side: a node with two connections from one
    router (after a rekey) that sends a sequence's token over the other one is not heard;
    the token from the sequence's own connection is."""
    streams: list[MxclStream] = []

    async def forging(stream: MxclStream) -> None:
        streams.append(stream)
        while True:
            env = parse_envelope(await stream.recv(), p.NODE_SPECS)
            if env.type == "attach":
                await stream.send(encode_envelope({
                    "t": "attached", "node": "node-a", "role": "hybrid", "model": MODEL,
                    "context_length": 64, "max_batch": 2}))
            elif env.type == "generate" and stream is not streams[0]:  # the first: held
                seq = env.header["seq"]
                for other in streams:
                    if other is not stream:
                        await other.send(encode_envelope(
                            {"t": "token", "seq": seq, "finish_reason": "length"},
                            [("tokens", "i32", (1,), struct.pack("<i", 7))]))
                await asyncio.sleep(0.3)  # the forged token is read first
                await stream.send(encode_envelope(
                    {"t": "token", "seq": seq, "finish_reason": "length"},
                    [("tokens", "i32", (1,), struct.pack("<i", 5))]))

    ring = keyring(SECRET)

    async def main() -> None:
        async with mxcl_serving(forging, channels={1},
                                keyring=keyring(SECRET, NEW_SECRET)) as listener, \
                remote_to(listener.port, keyring=ring) as remote:
            held = remote.generate(request([1, 2], 1))  # keeps the first connection open
            waiting = asyncio.create_task(anext(held))
            ring.add(NEW_SECRET, primary=True)
            remote.rekey()
            await until(lambda: len(streams) == 2, "a second connection", WAIT_S)
            await until(lambda: streams_under(key_id(NEW_SECRET)) == 2, "attached", WAIT_S)
            await asyncio.sleep(0.1)  # keep_linked installs the new stream after attach
            got = await tokens(remote, request([1, 2], 1))
            assert [out.token for out in got] == [5]
            assert not waiting.done()  # nor was the forged token the held sequence's
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await held.aclose()

    run(main())


def test_an_adopt_that_beat_its_sequence_is_said_again_at_its_first_answer() -> None:
    """The sequence's ``generate`` and the ``adopt`` go over two connections, so a node may
    read the ``adopt`` first and ignore it (a node of our own that does so): the router
    says it again once the node answered the sequence over the old connection; the node
    then moves it (``adopted`` over the old one), and its tokens come in order."""
    streams: list[MxclStream] = []
    adopts: list[str] = []
    heard = asyncio.Event()

    def token(seq: str, value: int, finish: str | None = None) -> bytes:
        header = {"t": "token", "seq": seq, **({"finish_reason": finish} if finish else {})}
        return bytes(encode_envelope(header, [("tokens", "i32", (1,),
                                                struct.pack("<i", value))]))

    async def racing(stream: MxclStream) -> None:
        streams.append(stream)
        while True:
            env = parse_envelope(await stream.recv(), p.NODE_SPECS)
            if env.type == "attach":
                await stream.send(encode_envelope({
                    "t": "attached", "node": "node-a", "role": "hybrid", "model": MODEL,
                    "context_length": 64, "max_batch": 2}))
            elif env.type == "generate":
                heard.set()
            elif env.type == "adopt":
                adopts.append(env.header["seq"])
                if len(adopts) == 1:  # ignored, as if it came before the generate
                    await streams[0].send(token(env.header["seq"], 5))
                else:
                    await streams[0].send(encode_envelope(
                        {"t": "adopted", "seq": env.header["seq"]}))
                    await stream.send(token(env.header["seq"], 6, "length"))

    ring = keyring(SECRET)

    async def main() -> None:
        async with mxcl_serving(racing, channels={1},
                                keyring=keyring(SECRET, NEW_SECRET)) as listener, \
                remote_to(listener.port, keyring=ring) as remote:
            held = remote.generate(request([1, 2], 2))
            first = asyncio.create_task(anext(held))
            await asyncio.wait_for(heard.wait(), WAIT_S)
            ring.add(NEW_SECRET, primary=True)
            remote.rekey()
            assert (await asyncio.wait_for(first, WAIT_S)).token == 5
            out = await asyncio.wait_for(anext(held), WAIT_S)
            assert (out.token, out.finish_reason) == (6, "length")
            assert len(adopts) == 2 and len(set(adopts)) == 1, adopts
            await held.aclose()
            await until(lambda: streams_under(key_id(SECRET)) == 0,
                        "the old stream finished", WAIT_S)

    run(main())
