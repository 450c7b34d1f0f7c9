"""Prefill/decode disaggregation against one node: the latency of short chats while long
prompts come in, and what a KV handoff costs per compression setting.

One run, one process, the ``small`` fixture, real MXCL links on 127.0.0.1 and real keys:

- ``hybrid``: one local engine served by a ``ServingService``, behind a router's
  ``RemoteEngine`` (the same kind of router as below: a replica pool of one);
- ``disagg``: a prefill node and a decode node, each with its own local engine (its own
  step thread), ``HandoffService``s, behind a router's ``DisaggEngine``.

The workload (``--chats`` short chats of ~30 prompt tokens and ``--new`` greedy tokens,
started ``--gap`` s apart, with ``--long`` prompts of ``--tokens`` tokens started among
them): for the short chats, the time to the first token (TTFT) and between tokens
(ITL), p50 and p95. Then, for each compression (none, int8, int4, each with and without
lz4), one ``--tokens``-token prompt through ``disagg``: the bytes handed off and the
prefill node's encode and send times, and the TTFT of that long prompt.

Both setups run in this one process: their engines' step threads share its cores (mlx
releases the GIL while it computes), so on a 2-core machine the prefill and decode
engines contend as two processes would, but nothing here is a separate host's network.

With ``--daemons`` the workload runs instead against real daemons on loopback (each MLX
process its own: ``bench/replicas.py``'s ``Daemon``, one cluster secret): one hybrid
node's own OpenAI port against a router (127.0.0.1) over a prefill node (127.0.0.2) and
a decode node (127.0.0.3), through the real OpenAI API (TTFT and mean inter-token time
per chat); the handoff table is then the router's ``/router/stats`` per compression
(one router per setting would restart; this mode prints the uncompressed one).

    .venv/bin/python bench/disagg.py [--tokens 2000] [--chats 16] [--long 3] [--new 24]
    .venv/bin/python bench/disagg.py --daemons [--tokens 2000] ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from mlxceld.engine import GenerationRequest, SamplingParams
from mlxceld.engine.handoff import Mode
from mlxceld.engine.loading import load_local_engine
from mlxceld.models import fixture_cache, preset
from mlxceld.replicas.disagg import DisaggEngine
from mlxceld.replicas.handoffs import HandoffService
from mlxceld.replicas.remote import RemoteEngine
from mlxceld.replicas.service import ServingService
from mlxceld.wire import key_id

SECRET = b"the disaggregation bench's secret, 40 b."
MODEL = "ab" * 32
CLUSTER = "bench"
ORIGIN = "127.0.0.1:19100"
MODES = [Mode(q, z) for q in ("none", "int8", "int4") for z in (False, True)]


class Keys:
    primary = SECRET
    primary_id = key_id(SECRET)

    def get(self, kid: bytes) -> bytes | None:
        return SECRET if kid == self.primary_id else None


def remote(node_id: str, address: str, role: str) -> RemoteEngine:
    async def resolve() -> str:
        return address

    return RemoteEngine(node_id, resolve, keyring=Keys(), origin=ORIGIN,
                        model_identity=MODEL, cluster=CLUSTER, silence_s=30.0, role=role)


@contextlib.asynccontextmanager
async def served(service: Any) -> AsyncIterator[Any]:
    await service.start()
    task = asyncio.create_task(service.serve())
    try:
        yield service
    finally:
        await service.aclose()
        await task


@contextlib.asynccontextmanager
async def linked(engine: Any, members: list[RemoteEngine]) -> AsyncIterator[Any]:
    tasks = [asyncio.create_task(m.keep_linked()) for m in members]
    try:
        while any(m.state() != "up" for m in members):
            await asyncio.sleep(0.01)
        yield engine
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for m in members:
            await m.aclose()


def options(node_id: str, role: str, engine: Any) -> dict[str, Any]:
    return dict(node_id=node_id, role=role, model_identity=MODEL, cluster=CLUSTER,
                keyring=Keys(), address="127.0.0.1:0", silence_s=30.0,
                vocab_size=engine.vocab_size)


ADMIT = asyncio.Semaphore(8)  # the API's admission: at most max_batch at once, the rest wait


async def timed(engine: Any, prompt: list[int], new: int) -> tuple[float, list[float]]:
    """TTFT (its wait for admission included) and each inter-token gap, in seconds."""
    start = time.perf_counter()
    marks = []
    request = GenerationRequest("b", prompt, SamplingParams(max_tokens=new, temperature=0))
    async with ADMIT:
        async for _ in engine.generate(request):
            marks.append(time.perf_counter())
    return marks[0] - start, [b - a for a, b in itertools.pairwise(marks)]


async def workload(engine: Any, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    rng = random.Random(7)
    chats = [[rng.randrange(vocab) for _ in range(30)] for _ in range(args.chats)]
    longs = [[rng.randrange(vocab) for _ in range(args.tokens)] for _ in range(args.long)]
    every = max(1, args.chats // max(1, args.long))
    results: list[tuple[float, list[float]]] = []
    tasks: list[asyncio.Task[Any]] = []

    async def chat(prompt: list[int]) -> None:
        results.append(await timed(engine, prompt, args.new))

    for i, prompt in enumerate(chats):
        if i % every == 0 and longs:
            tasks.append(asyncio.create_task(timed(engine, longs.pop(), args.new)))
        tasks.append(asyncio.create_task(chat(prompt)))
        await asyncio.sleep(args.gap)
    await asyncio.gather(*tasks)
    ttft = sorted(r[0] for r in results)
    itl = sorted(g for r in results for g in r[1])
    return {"ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95)}


def pct(values: list[float], p: int) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1] * 1000


async def main(args: argparse.Namespace) -> None:
    path = str(fixture_cache(preset("small")))
    hybrid_engine, _ = load_local_engine(path, max_batch=8)
    prefill_engine, _ = load_local_engine(path, max_batch=8)
    decode_engine, _ = load_local_engine(path, max_batch=8)
    vocab = hybrid_engine.vocab_size
    try:
        async with served(ServingService(hybrid_engine, **options("hybrid", "hybrid",
                                                                   hybrid_engine))) as h:
            member = remote("hybrid", f"127.0.0.1:{h.port}", "hybrid")
            async with linked(member, [member]) as engine:
                await timed(engine, [1, 2, 3], 4)  # warm up
                hybrid = await workload(engine, args, vocab)
        async with contextlib.AsyncExitStack() as stack:
            d = await stack.enter_async_context(served(HandoffService(
                decode_engine, prefill_peers=lambda: {p.origin},
                **options("decode", "decode", decode_engine))))
            p = await stack.enter_async_context(served(HandoffService(
                prefill_engine, allowlist=None, **options("prefill", "prefill",
                                                          prefill_engine))))
            members = [remote("prefill", p.origin, "prefill"),
                       remote("decode", d.origin, "decode")]
            router = DisaggEngine(members[:1], members[1:], model_id=MODEL,
                                  context_length=hybrid_engine.context_length)
            async with linked(router, members) as engine:
                await timed(engine, [1, 2, 3], 4)
                disagg = await workload(engine, args, vocab)
                print(f"small fixture; {args.chats} chats of 30 tokens + {args.long} prompts "
                      f"of {args.tokens} tokens, {args.new} new tokens each, {args.gap} s "
                      "apart (ms)")
                print(f"{'':8} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8}")
                for name, r in (("hybrid", hybrid), ("disagg", disagg)):
                    print(f"{name:8} {r['ttft_p50']:9.1f} {r['ttft_p95']:9.1f} "
                          f"{r['itl_p50']:8.1f} {r['itl_p95']:8.1f}")
                print("ratio    " + " ".join(f"{disagg[k] / hybrid[k]:9.2f}" for k in
                                            ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95")))
                print(f"\none {args.tokens}-token prompt per KV compression (disagg)")
                print(f"{'mode':10} {'bytes':>11} {'vs none':>8} {'encode ms':>10} "
                      f"{'send ms':>8} {'TTFT ms':>8}")
                rng = random.Random(11)
                prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
                plain = 0
                for mode in MODES:
                    router.mode = mode
                    before = router.stats(verbose=False)["handoff"]
                    ttft, _ = await timed(engine, prompt, 2)
                    after = router.stats(verbose=False)["handoff"]
                    size = after["bytes"] - before["bytes"]
                    plain = plain or size
                    print(f"{mode!s:10} {size:11,d} {size / plain:8.2f} "
                          f"{after['encode_ms'] - before['encode_ms']:10.1f} "
                          f"{after['send_ms'] - before['send_ms']:8.1f} {ttft * 1000:8.1f}")
    finally:
        for e in (hybrid_engine, prefill_engine, decode_engine):
            await e.aclose()


def daemons_run(args: argparse.Namespace) -> None:
    """The workload against real daemons (see the module docstring)."""
    import secrets as pysecrets
    import shutil
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import httpx
    from replicas import Daemon, wait  # bench/replicas.py: the daemons as a service starts them
    from streams import Stream, timed

    from mlxceld.models import write_fixture

    root = Path(tempfile.mkdtemp(prefix="mxdg", dir="/tmp"))
    started: list[Daemon] = []
    try:
        model = root / "small"
        write_fixture(model, preset("small"))
        secret = root / "cluster.secret"
        secret.write_text(pysecrets.token_hex(32) + "\n")
        secret.chmod(0o600)
        base = {"model": str(model), "model_name": "m", "max_batch": 8}
        hybrid = Daemon(root, "h", "127.0.0.4", {**base, "host": "127.0.0.1"}).start(secret)
        prefill = Daemon(root, "p", "127.0.0.2", {**base, "node_role": "prefill"}).start(secret)
        started += [hybrid, prefill]
        decode = Daemon(root, "d", "127.0.0.3", {**base, "node_role": "decode",
                                                 "prefill_peers": [prefill.agent]}
                        ).start(secret)
        started.append(decode)
        router = Daemon(root, "r", "127.0.0.1", {**base, "node_role": "router",
                                                 "prefill_peers": [prefill.agent],
                                                 "decode_peers": [decode.agent]}).start(secret)
        started.append(router)
        wait("the hybrid's port", lambda: httpx.get(f"{hybrid.url}/ready", timeout=5)
             .status_code == 200, hybrid)
        wait("the router's nodes", lambda: httpx.get(f"{router.url}/router/stats", timeout=5)
             .json().get("up") == 2, router)
        rng = random.Random(7)
        words = ["alpha", "beta", "gamma", "delta", "sea", "village", "time", "story"]

        def text(n: int) -> str:
            return " ".join(rng.choice(words) for _ in range(n))

        def one(url: str, prompt: str) -> Stream:
            body = {"model": "m", "prompt": prompt, "max_tokens": args.new, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as r:
                return timed(r, start)

        def workload_of(url: str) -> dict[str, float]:
            one(url, "warm up")
            chats = [text(25) for _ in range(args.chats)]
            longs = [text(args.tokens) for _ in range(args.long)]  # ~1 token a word or more
            every = max(1, args.chats // max(1, args.long))
            with ThreadPoolExecutor(args.chats + args.long) as pool:
                futures, chat_futures = [], []
                for i, prompt in enumerate(chats):
                    if i % every == 0 and longs:
                        futures.append(pool.submit(one, url, longs.pop()))
                    chat_futures.append(pool.submit(one, url, prompt))
                    time.sleep(args.gap)
                done = [f.result() for f in chat_futures]
                for f in futures:
                    f.result()
            ttft = sorted(d.ttft for d in done)
            itl = sorted(d.decode_s / max(d.tokens - 1, 1) for d in done)
            return {"ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
                    "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95)}

        results = {"hybrid": workload_of(hybrid.url), "disagg": workload_of(router.url)}
        print(f"small fixture, real daemons; {args.chats} chats of ~25 words + {args.long} "
              f"prompts of ~{args.tokens} words, {args.new} new tokens each, {args.gap} s "
              "apart (ms; ITL: each chat's mean)")
        print(f"{'':8} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8}")
        for name, r in results.items():
            print(f"{name:8} {r['ttft_p50']:9.1f} {r['ttft_p95']:9.1f} {r['itl_p50']:8.1f} "
                  f"{r['itl_p95']:8.1f}")
        h, d = results["hybrid"], results["disagg"]
        print("ratio    " + " ".join(f"{d[k] / h[k]:9.2f}" for k in h))
        print("handoffs (none):", httpx.get(f"{router.url}/router/stats", timeout=5)
              .json()["handoff"])
    finally:
        for daemon in reversed(started):
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--long", type=int, default=3)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--gap", type=float, default=0.1)
    parser.add_argument("--daemons", action="store_true", help="real daemons (see above)")
    parsed = parser.parse_args()
    if parsed.daemons:
        daemons_run(parsed)
    else:
        asyncio.run(main(parsed))
