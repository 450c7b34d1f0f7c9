"""Which worker roles exist and where their entry points live.

Kept free of heavy imports: the daemon validates configs against this table
without loading any model runtime.
"""

from __future__ import annotations

from typing import Final

ECHO: Final = "echo"  # a test worker (workers/echo.py)
ROUTER: Final = "router"  # the OpenAI port: only from [serve] or a plan, never from [workers]
STAGE: Final = "stage"  # a pipeline stage: only from a cluster TOML, never from [workers]
TP: Final = "tp"  # a tensor-parallel rank >= 1: only from [serve] tp_size, never from [workers]
# A tensor-parallel stage's rank >= 1: only from [serve] tp_size on a stage host.
STAGE_TP: Final = "stage_tp"

# role -> module with ``async def run(ctx: WorkerContext[ITS_OPTIONS]) -> int``
WORKER_ROLES: dict[str, str] = {
    ECHO: "mlxceld.workers.echo",
    ROUTER: "mlxceld.workers.router",
    STAGE: "mlxceld.workers.stage",
    TP: "mlxceld.workers.tensor_rank",
    STAGE_TP: "mlxceld.workers.stage_tensor",
}
