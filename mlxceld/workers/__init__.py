"""Worker subprocess entry points, one module per role."""

from mlxceld.roles import ROLES

__all__ = ["ROLES"]
