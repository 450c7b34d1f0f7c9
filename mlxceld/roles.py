"""Which worker roles exist and where their entry points live.

Kept free of heavy imports: the daemon validates configs against this table
without loading any model runtime.
"""

from __future__ import annotations

STAGE = "stage"  # a pipeline stage: only from a cluster TOML, never from [workers]

# role -> module with ``async def run(ctx: WorkerContext) -> int``
ROLES: dict[str, str] = {
    "echo": "mlxceld.workers.echo",
    "router": "mlxceld.workers.router",
    "stage": "mlxceld.workers.stage",
}
