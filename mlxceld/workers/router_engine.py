"""What the router worker runs over, whatever its mode: ``RouterEngine``.

One subclass per mode (``modes.py``), as vLLM's engine clients are: ``LocalRouter``
and ``TensorRouter`` (``engines.py``), ``PipelineRouter`` and ``GroupsRouter``
(``pipeline_router.py``), ``ReplicasRouter`` (``replica_router.py``). Each holds the
engine the app drives (``engine/base.py``'s ``Engine``), the tokenizer and the model's
path, and says what the app shows of it (``AppHooks``), which control ops it answers
(``attach``), what it adds to the worker's stats each tick (``refresh``), and what its
serving listener names (``serving_identity``, ``vocab_size``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxceld.api.edge.metrics import Continuities, PromptCaches, Speculations, StageLinks
from mlxceld.engine import Engine
from mlxceld.roles.options import RouterOptions
from mlxceld.workers.runtime import WorkerContext


@dataclass(frozen=True)
class AppHooks:
    """What ``api.build_router_app`` shows of the engine besides generating (its
    arguments of the same names)."""

    readiness: Callable[[], Mapping[str, Any] | None] | None = None
    router_stats: Callable[[bool], Any] | None = None
    stage_links: StageLinks | None = None
    prompt_caches: PromptCaches | None = None
    continuity: Continuities | None = None
    speculation: Speculations | None = None
    elastic: bool = False


class RouterEngine:
    """``engine`` behind the OpenAI port; ``tokenizer`` mlx-lm's ``TokenizerWrapper``
    (untyped there); ``path`` the model's local directory, or the name it was given
    (a repo id) where this router holds no weights."""

    def __init__(self, engine: Engine, tokenizer: Any, path: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.path = path

    def hooks(self) -> AppHooks:
        return AppHooks()

    def attach(self, ctx: WorkerContext[RouterOptions]) -> None:
        """Install the control ops and key handovers this mode answers."""

    async def keep_linked(self) -> None:
        """Keep the engine's links up until cancelled (none here: returns)."""

    def refresh(self, stats: dict[str, Any], now: float) -> None:
        """Add this tick's engine stats to the worker's ``stats``."""

    async def serving_identity(self) -> str:
        """The model identity routers must name to the serving listener."""
        from mlxceld.models.identity import model_identity

        return await asyncio.to_thread(model_identity, Path(self.path))

    @property
    def vocab_size(self) -> int | None:
        """The token ids the serving listener checks (None: the engine checks them)."""
        return None

    async def aclose(self) -> None:
        await self.engine.aclose()
