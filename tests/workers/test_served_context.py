"""The routers that hold no weights take their context from the model's config and
``[serve] context_length`` as the local engine does (``models/context.py``): over a
pipeline (``PipelineMode``) and over replicas or prefill and decode pools
(``DisaggMode``), each built by ``make_engine``. Built, never dialled."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlxceld.roles import ROUTER
from mlxceld.roles.options import (
    PipelineOptions,
    PipelineStage,
    ReplicasOptions,
    RouterOptions,
)
from mlxceld.workers.engines import make_engine
from mlxceld.workers.modes import engine_mode
from mlxceld.workers.runtime import WorkerContext

from helpers.keys import keyring

SECRET = b"the served context tests' secret."
PIPELINE = PipelineOptions(
    stages=(PipelineStage("s0", "127.0.0.1:9", 0, (0, 2)),), coordinator="127.0.0.1:19000",
    model_identity="x", cluster="c")
REPLICAS = ReplicasOptions(agents=("127.0.0.2:19000",), origin="127.0.0.1:19000", cluster="c",
                           prefill_agents=("127.0.0.3:19000",),
                           decode_agents=("127.0.0.4:19000",))


def context(model: Path, cap: int | None, **where: Any) -> int:
    options = RouterOptions(model=str(model), model_name="llama", host="127.0.0.1", port=8080,
                            max_batch=2, max_queued=4, context_length=cap, **where)
    ctx = WorkerContext("router", ROUTER, options, model, keyring=keyring(SECRET))

    async def build() -> int:
        built = await make_engine(engine_mode(options), ctx, lambda exc: None)
        try:
            return int(built.engine.context_length)
        finally:
            await built.aclose()

    return asyncio.run(build())


@pytest.mark.parametrize("where", [{"pipeline": PIPELINE}, {"replicas": REPLICAS}],
                         ids=["pipeline", "disaggregated"])
def test_the_cap_bounds_a_router_without_weights(fixture_dir: Path,
                                                 where: dict[str, Any]) -> None:
    model = fixture_dir / "llama"  # its config says 2048
    assert context(model, None, **where) == 2048
    assert context(model, 100, **where) == 100
    assert context(model, 10**6, **where) == 2048  # a ceiling: the model's
