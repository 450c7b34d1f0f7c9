"""Worker subprocess entry points, one module per role."""

from mlxceld.workers.roles import ROLES

__all__ = ["ROLES"]
