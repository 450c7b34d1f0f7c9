"""A router's pipeline engine that moves to a new plan's stages without a restart.

The router serves through a ``PipelineSwitch``: every new sequence goes to the current
``PipelineEngine``; ``switch(engine)`` makes another one current (the daemon's ``pipeline``
op, as a drain's re-plan serves, ``cluster/healer.py``). The engine it replaces keeps the
sequences it runs to their end, then is closed: it retires once it has none left, or
after ``RETIRE_S`` at most (a sequence still running then goes on on the current engine,
its prompt and the tokens sent prefilled there: ``replay.py``) (its stages' own drains end within
``pipeline.stage.DRAIN_S``, 15 s). Its links are kept up meanwhile, the new engine's are
brought up at once (``keep_linked``).

``retiring`` counts the replaced engines not closed yet: a coordinator asks it (the
``retiring`` op) and tells the old plan's hosts it kept that the plan is over once it is 0
(``cluster/healer.py``: make before break). ``readiness`` and ``stages`` (what `/ready`
and `mlxctl status` show) are the current engine's; ``active_sequences`` counts the
retiring engines' sequences too, and ``tokens`` every engine's since the router started (a
count that never goes back, for tokens/s).
A keyring change (``rekey``) reaches the retiring engines as well as the current one.

Every sequence runs through ``replay.py``: with ``hold_s`` above 0 (the router's
``replay_hold_s``: a plan the coordinator heals), a sequence whose stage is lost is held
and replayed on a working engine rather than failed; ``working`` is that wait: until a
switch brings another engine, or the failed one has every stage attached again, ``hold_s``
at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Final

from mlxceld.engine.base import GenerationRequest, TokenOutput
from mlxceld.engine.continuation import Continuity
from mlxceld.pipeline.engine import PipelineEngine
from mlxceld.pipeline.replay import replayed
from mlxceld.types import PipelineCacheStats

log = logging.getLogger(__name__)

RETIRE_S: Final = 30.0  # a replaced engine's sequences get this long, then it is closed
POLL_S: Final = 0.1  # between two looks at a retiring engine's sequences


class PipelineSwitch:
    def __init__(self, engine: PipelineEngine, *, hold_s: float = 0.0) -> None:
        """``hold_s``: how long a sequence whose stage is lost is held for a working
        engine (0: it fails at once)."""
        self._current = engine
        self.hold_s = hold_s
        self.continuity = Continuity()  # ``replayed``'s counts, for /metrics
        self._retiring: list[PipelineEngine] = []
        self._retired_tokens = 0  # the tokens of the engines closed since
        self._changed = asyncio.Event()
        self._switched = asyncio.Event()  # set at each switch, for ``working``'s waits
        self.model_id = engine.model_id
        self.context_length = engine.context_length
        self.max_batch = engine.max_batch

    @property
    def current(self) -> PipelineEngine:
        return self._current

    def switch(self, engine: PipelineEngine) -> None:
        """New sequences go to ``engine`` from now on; the current one retires."""
        self._retiring.append(self._current)
        self._current = engine
        self._changed.set()
        self._switched.set()
        self._switched = asyncio.Event()
        log.info("pipeline: new sequences go to the new plan's stages; the old engine "
                 "retires once its %d sequence(s) end (%g s at most)",
                 self._retiring[-1].active_sequences(), RETIRE_S)

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        return replayed(self, request, self.hold_s)

    async def working(self, failed: PipelineEngine, until: float) -> PipelineEngine | None:
        """The engine to replay a sequence on that ``failed`` lost a stage of: the current
        one once a switch replaced ``failed``, or ``failed`` once every stage of it is
        attached again; None if neither by ``until`` (``time.monotonic()``)."""
        while True:
            current = self._current
            if current is not failed or failed.readiness() is None:
                return current
            left = until - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, POLL_S)):
                    await self._switched.wait()

    def retiring(self) -> int:
        """Replaced engines not closed yet (their sequences still run on the old stages)."""
        return len(self._retiring)

    def active_sequences(self) -> int:
        return self._current.active_sequences() + sum(e.active_sequences()
                                                      for e in self._retiring)

    @property
    def tokens(self) -> int:
        """Tokens generated through every engine this switch has served with."""
        return self._retired_tokens + self._current.tokens + sum(
            e.tokens for e in self._retiring)

    def rekey(self) -> None:
        """The keyring's primary changed: every engine's links hand over (``links.py``)."""
        for engine in [self._current, *self._retiring]:
            engine.rekey()

    def readiness(self) -> dict[str, Any] | None:
        return self._current.readiness()

    def stages(self) -> list[dict[str, Any]]:
        return self._current.stages()

    def prompt_cache_stats(self) -> PipelineCacheStats:
        """The current engine's: a new plan's engine starts with an empty one, and its
        stages drop what the old one had them keep (``prefixes.py``)."""
        return self._current.prompt_cache_stats()

    async def keep_linked(self) -> None:
        """The current engine's links kept up; after a switch, the new one's too, and each
        replaced engine retired in the background. Until cancelled."""
        links: dict[PipelineEngine, asyncio.Task[None]] = {}
        retired: set[PipelineEngine] = set()
        async with asyncio.TaskGroup() as tg:
            while True:
                current = self._current
                if current not in links:
                    links[current] = tg.create_task(current.keep_linked())
                for engine in self._retiring:
                    if engine not in retired:
                        retired.add(engine)
                        tg.create_task(self._retire(engine, links.pop(engine, None)))
                await self._changed.wait()
                self._changed.clear()

    async def _retire(self, engine: PipelineEngine, linking: asyncio.Task[None] | None
                      ) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(RETIRE_S):
                while engine.active_sequences():
                    await asyncio.sleep(POLL_S)
        left = engine.active_sequences()
        (log.warning if left else log.info)(
            "pipeline: the old plan's engine retires%s", f" ending {left} sequence(s) after "
            f"{RETIRE_S:g} s" if left else ": its sequences ended")
        if linking is not None:
            linking.cancel()
        try:
            await engine.aclose()
        finally:
            self._retiring.remove(engine)
            self._retired_tokens += engine.tokens

    async def aclose(self) -> None:
        for engine in [*self._retiring, self._current]:
            await engine.aclose()
