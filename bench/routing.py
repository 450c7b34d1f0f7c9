"""What a replica pool costs the router, baseline and ours side by side in one run:

- decision: ``Routing.choose`` + ``dispatch`` + a token + ``end`` for a
  ``--prompt``-token prompt (2,048) over ``--members`` (8) members whose prefix
  shadows are full (256 sequences of that length each), in microseconds per
  request; the baseline is round-robin (no account, no hashing). Prefix hashing
  dominates, so the cost grows with the prompt, not with the shadow.
- pass-through: 8 concurrent greedy streams of ``--tokens`` (64) tokens on one
  local engine (the ``tiny`` fixture, or ``--model DIR``), asked directly and
  through a ``ReplicaEngine`` whose one member is that engine: aggregate tokens/s
  of each, alternated ``--runs`` (3) times, the median; a ratio near 1 means the
  pool adds nothing a client would see.

    .venv/bin/python bench/routing.py [--members 8] [--prompt 2048] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from mlxceld.engine import Engine, GenerationRequest, SamplingParams, TokenOutput
from mlxceld.engine.loading import load_local_engine
from mlxceld.models import preset, write_fixture
from mlxceld.replicas.pool import ReplicaEngine
from mlxceld.replicas.routing import SHADOW_SEQUENCES, Routing


def decision_us(members: int, prompt_len: int, requests: int = 2000) -> tuple[float, float]:
    """Microseconds per request: (round-robin, Routing), both over the same prompts."""
    nodes = [f"replica-{i}" for i in range(members)]
    routing = Routing(dict.fromkeys(nodes, 1 << 20))
    for i, node in enumerate(itertools.islice(itertools.cycle(nodes),
                                              members * SHADOW_SEQUENCES)):
        routing.nodes[node].shadow.remember([(i * 31 + t) % 50000 for t in range(prompt_len)])
    prompts = [[(i * 17 + t) % 50000 for t in range(prompt_len)] for i in range(16)]

    start = time.perf_counter()
    turn = itertools.cycle(nodes)
    for i in range(requests):
        _ = prompts[i % 16], next(turn)
    rr = (time.perf_counter() - start) / requests * 1e6

    start = time.perf_counter()
    for i in range(requests):
        prompt = prompts[i % 16]
        choice = routing.choose(prompt, nodes)
        assert choice is not None
        routing.dispatch(i, choice, prompt, 8)
        routing.token(i, 1)
        routing.end(i, "cancelled")
    ours = (time.perf_counter() - start) / requests * 1e6
    return rr, ours


class OneMember:
    """The engine as the pool's only member."""

    node_id, address, role = "replica-0", "127.0.0.1:1", "hybrid"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_id, self.context_length = engine.model_id, engine.context_length
        self.max_batch = engine.max_batch

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        return self.engine.generate(request)

    def active_sequences(self) -> int:
        return self.engine.active_sequences()

    async def aclose(self) -> None:
        pass

    def state(self) -> str:
        return "up"

    def last_error(self) -> str | None:
        return None


async def streams_tps(engine: Any, prompts: list[list[int]], n: int) -> float:
    async def one(i: int, prompt: list[int]) -> int:
        req = GenerationRequest(f"b{i}", prompt, SamplingParams(max_tokens=n, temperature=0))
        return sum([1 async for _ in engine.generate(req)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts) / (time.perf_counter() - start)


async def pass_through(model: str, n: int, runs: int) -> tuple[float, float]:
    engine, tokenizer = load_local_engine(model, max_batch=8)
    try:
        prompts = [tokenizer.encode(f"stream {i}: the quick brown fox") for i in range(8)]
        pool = ReplicaEngine([OneMember(engine)], model_id="bench", context_length=4096)
        await streams_tps(engine, prompts, n)  # warm up
        direct, pooled = [], []
        for _ in range(runs):
            direct.append(await streams_tps(engine, prompts, n))
            pooled.append(await streams_tps(pool, prompts, n))
        return statistics.median(direct), statistics.median(pooled)
    finally:
        await engine.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a checkpoint (default: tiny fixture)")
    args = parser.parse_args()
    rr, ours = decision_us(args.members, args.prompt)
    print(f"decision, {args.members} members, {args.prompt}-token prompt, full shadows: "
          f"round-robin {rr:.1f} us, routing {ours:.1f} us per request "
          f"({ours - rr:.1f} us more)")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "tiny"
            write_fixture(model, preset("tiny"))
        direct, pooled = asyncio.run(pass_through(str(model), args.tokens, args.runs))
    print(f"pass-through, 8 streams x {args.tokens} tokens: engine {direct:.0f} tok/s, "
          f"pool of it {pooled:.0f} tok/s, ratio {pooled / direct:.2f}")


if __name__ == "__main__":
    main()
