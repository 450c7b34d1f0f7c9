"""A replica pool's member over any engine in this process: our own fake of the ``Member``
seam (``mlxceld.replicas.pool``), whose state a test sets; an engine with its links kept
up for a block (``linked``); a request and its outputs in one call (``request``,
``tokens``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxceld.engine import (
    Engine,
    EngineUnavailable,
    GenerationRequest,
    SamplingParams,
    TokenOutput,
)


@dataclass
class EngineMember:
    """``engine`` as the pool member ``node_id``. ``down(reason)`` marks it down and fails
    its sequences in flight at their next token, as a ``RemoteEngine`` whose link broke;
    ``refuse(n)`` makes its next ``n`` requests raise ``EngineUnavailable`` at once, as a
    node that is busy. ``requests``: the ids of the requests it was given."""

    engine: Engine
    node_id: str
    address: str = "127.0.0.9:19100"
    role: str = "hybrid"
    requests: list[str] = field(default_factory=list)
    _state: str = "up"
    _error: str | None = None
    _refusals: int = 0
    rekeyed: int = 0
    model_id: str = field(init=False)
    context_length: int = field(init=False)
    max_batch: int = field(init=False)

    def __post_init__(self) -> None:
        self.model_id = self.engine.model_id
        self.context_length = self.engine.context_length
        self.max_batch = self.engine.max_batch

    def state(self) -> str:
        return self._state

    def last_error(self) -> str | None:
        return self._error

    def down(self, reason: str) -> None:
        self._state, self._error = "down", reason

    def up(self) -> None:
        self._state = "up"

    def refuse(self, n: int = 1) -> None:
        self._refusals = n

    def rekey(self) -> None:
        self.rekeyed += 1

    def active_sequences(self) -> int:
        return self.engine.active_sequences()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        self.requests.append(request.request_id)
        if self._refusals:
            self._refusals -= 1
            raise EngineUnavailable(f"the node at {self.address} is busy", retry_after_s=3)
        if self._state != "up":
            raise EngineUnavailable(f"the link to {self.address} is down")
        stream = self.engine.generate(request)
        try:
            async for out in stream:
                if self._state != "up":
                    raise EngineUnavailable(f"the link to {self.address} broke: {self._error}")
                yield out
        finally:
            await stream.aclose()

    async def aclose(self) -> None:
        await self.engine.aclose()


@contextlib.asynccontextmanager
async def linked(engine: Any) -> AsyncIterator[Any]:
    """``engine`` (a pool, a ``RemoteEngine``, a disaggregated router) with its links kept
    up (``keep_linked``) while the block runs; then the keeper cancelled and the engine
    closed."""
    linking = asyncio.create_task(engine.keep_linked())
    try:
        yield engine
    finally:
        linking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await linking
        await engine.aclose()


def request(prompt: Sequence[int], n: int, **params: Any) -> GenerationRequest:
    """A request for ``n`` tokens after ``prompt`` with ``params`` (``SamplingParams``)."""
    return GenerationRequest("r", prompt, SamplingParams(max_tokens=n, **params))


async def tokens(engine: Any, req: GenerationRequest) -> list[Any]:
    """Every output of ``req`` on ``engine``."""
    return [out async for out in engine.generate(req)]
