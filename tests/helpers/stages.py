"""Stage services and the pipeline engine in one process, over real MXCL on 127.0.0.x: each
stage a real fixture slice behind its own listener (127.0.0.(2 + rank)), the engine
dialing them as the coordinator would; and mlx-lm's own greedy tokens to compare with."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlxceld.engine import GenerationRequest, SamplingParams
from mlxceld.engine.speculative import Draft
from mlxceld.models.identity import model_identity
from mlxceld.models.slicing import load_stage
from mlxceld.net import Listener
from mlxceld.pipeline import PipelineEngine, StageAddress, StagePlace, StageService
from mlxceld.wire import Keyring

from helpers.keys import keyring

SECRET = b"pipeline-test-secret-0123456789"
COORD = "127.0.0.1:19999"


def reference(path: Path, prompt: list[int], n: int) -> list[int]:
    model, _ = load(str(path))
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                  sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(token))
    return out


class Cluster:
    """Stage services on 127.0.0.(2+rank), each behind its own listener."""

    def __init__(self, ring: Keyring | None = None) -> None:
        self.ring = ring or keyring(SECRET)  # every stage's and the engine's, one object
        self.listeners: list[Listener] = []
        self.services: list[StageService] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.stages: list[StageAddress] = []

    async def start(self, path: Path, splits: Sequence[tuple[int, int]],
                    identity: str | None = None, standby: bool = False,
                    cache_bytes: int = 1 << 30, draft: Path | None = None,
                    k: int = 4) -> None:
        """``draft``: the last stage's draft model (``pipeline/speculating.py``), ``k``
        its proposals a pass."""
        ident = identity or model_identity(path)
        listeners = []
        for rank in range(len(splits)):
            host = f"127.0.0.{2 + rank}"
            lst = Listener(host, 0, keyring=self.ring, identity_of_server=f"{host}:0",
                           channels={1}, handler=self._handler(rank))
            await lst.start()
            listeners.append(lst)
        addrs = [f"{lst.host}:{lst.port}" for lst in listeners]
        for rank, (start, end) in enumerate(splits):
            model = load_stage(path, start, end)
            place = StagePlace(
                node_id=f"stage-{rank}", rank=rank, layers=(start, end), address=addrs[rank],
                coordinator=COORD, upstream=addrs[rank - 1] if rank else None,
                downstream=(listeners[rank + 1].host, listeners[rank + 1].port)
                if rank + 1 < len(splits) else None,
                model_identity=ident, cluster="test",
                first=(listeners[0].host, listeners[0].port)
                if rank == len(splits) - 1 and rank > 0 else None,
                last=addrs[-1] if rank == 0 and len(splits) > 1 else None)
            last = rank == len(splits) - 1
            svc = StageService(model, place, self.ring, model.wire_dtype, standby=standby,
                               cache_bytes=cache_bytes,
                               draft=Draft(load(str(draft))[0], k) if draft and last else None)
            self.services.append(svc)
            self.tasks.append(asyncio.ensure_future(svc.run()))
            self.tasks.append(asyncio.ensure_future(listeners[rank].serve()))
            self.stages.append(StageAddress(f"stage-{rank}", listeners[rank].host,
                                            listeners[rank].port, rank, (start, end)))
        for lst in listeners:
            await lst.wait_accepting()
        self.listeners = listeners

    def _handler(self, rank: int) -> Any:
        async def handle(stream: Any) -> None:
            await self.services[rank].handle(stream)
        return handle

    def engine(self, path: Path, eos: set[int] | None = None, **knobs: Any) -> PipelineEngine:
        return PipelineEngine(self.stages, keyring=self.ring, origin=COORD,
                              model_identity=model_identity(path),
                              cluster="test", model_id="m", context_length=4096,
                              eos_token_ids=eos or set(), **knobs)

    async def stop_stage(self, rank: int) -> None:
        """Its listener goes away: every connection to it drops, new ones are refused."""
        await self.listeners[rank].aclose()

    async def restart_stage(self, rank: int) -> None:
        """A new listener on the same address, in front of the same stage service."""
        st = self.stages[rank]
        lst = Listener(st.host, st.port, keyring=self.ring,
                       identity_of_server=f"{st.host}:0", channels={1},
                       handler=self._handler(rank))
        await lst.start()
        self.tasks.append(asyncio.ensure_future(lst.serve()))
        await lst.wait_accepting()
        self.listeners[rank] = lst

    async def aclose(self) -> None:
        for svc in self.services:
            await svc.aclose()
        for lst in self.listeners:
            await lst.aclose()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


@contextlib.asynccontextmanager
async def cluster(path: Path, splits: Sequence[tuple[int, int]],
                  identity: str | None = None, standby: bool = False,
                  ring: Keyring | None = None, cache_bytes: int = 1 << 30,
                  draft: Path | None = None, k: int = 4) -> AsyncIterator[Cluster]:
    c = Cluster(ring)
    try:
        await c.start(path, splits, identity, standby, cache_bytes, draft, k)
        yield c
    finally:
        await c.aclose()


async def tokens_of(engine: PipelineEngine, prompt: list[int], n: int) -> list[int]:
    req = GenerationRequest("r", prompt, SamplingParams(max_tokens=n, temperature=0.0))
    return [t.token async for t in engine.generate(req)]
