"""``compute_units``: how fast a host decodes, as the planner weighs it.

``[daemon] compute_units`` (no flag) and a cluster TOML's ``[nodes.resources]
compute_units`` take a number of compute units (``models/speed.py``: GB/s of weights
through a decode-shaped matrix product; a relative number works too, as only the ratios
between hosts change a split). ``0`` or no key: the daemon measures them at start
(``discovery/speed.py``). A negative number, a boolean or a string is refused, naming the
key. A reload that changes it applies at once (the next inventory answer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from mlxceld.errors import ConfigError

KEY: Final = "compute_units"
HINT: Final = ("a number of compute units (GB/s of weights through a decode matmul, or any "
               "scale shared by the cluster's hosts), e.g. compute_units = 100; 0 measures "
               "them at start")


def check_units(value: object, what: str) -> float:
    """``value`` as compute units (0: measure); ``ConfigError`` naming ``what`` if it is not
    a finite number of at least 0."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value < 0):
        raise ConfigError(f"{what} must be a number of at least 0, not {value!r}", hint=HINT)
    return float(value)


def compute_units(daemon: Mapping[str, Any], where: str) -> float | None:
    """The Config field ``compute_units`` from [daemon]: None to measure (0, or no key)."""
    if KEY not in daemon:
        return None
    return check_units(daemon[KEY], f"{where}: 'daemon.{KEY}'") or None
