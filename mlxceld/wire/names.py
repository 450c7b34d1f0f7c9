"""Node ids and cluster names: the rule the cluster TOML, the daemon's config, the
inventory and discovery records share.

A name is 1 to ``MAX_NAME`` characters with no control characters; the cluster's
default name is ``DEFAULT_CLUSTER_NAME``.
"""

from __future__ import annotations

import unicodedata
from typing import Final

DEFAULT_CLUSTER_NAME: Final = "mlxcel-cluster"
MAX_NAME: Final = 128


def name_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a node id or cluster name, or None."""
    if not isinstance(value, str):
        return f"must be a string, not {shown(value)}"
    if not value:
        return "must not be empty"
    if len(value) > MAX_NAME:
        return f"is {len(value)} characters long; at most {MAX_NAME} are allowed"
    bad = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        return f"contains the control character U+{ord(bad):04X}"
    return None


def shown(value: object) -> str:
    """A value as TOML would write it, near enough for a message."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
