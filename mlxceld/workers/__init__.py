"""Worker subprocess entry points, one module per role."""

from mlxceld.roles import WORKER_ROLES

__all__ = ["WORKER_ROLES"]
