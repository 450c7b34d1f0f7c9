"""Self-healing's one setting: the [daemon] key ``heal_after_s`` (no flag; a reload does
not change it: it takes effect at the next start).

On a coordinator serving a plan it pushed (``mlxctl cluster activate``, ``pp_auto``), a
stage's host that the failure detector holds ``dead`` (``config/liveness.py``) for
``heal_after_s`` (default 60 s) makes the coordinator plan again over the peers alive and
push the new plan (``mlxceld/cluster/healing.py``). ``0`` turns self-healing off: a dead
peer is then only shown as a problem in ``mlxctl status``. Otherwise a number of seconds
in (0, 3600]. The grace counts from the moment the peer was declared dead, so a host is
healed around ``peer_dead_after_s + heal_after_s`` after its last answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mlxceld.errors import ConfigError

KEY: Final = "heal_after_s"
DEFAULT_S: Final = 60.0
MAX_S: Final = 3600.0


def heal_after(daemon: Mapping[str, Any], where: str) -> float:
    """The Config field ``heal_after_s`` from [daemon], checked (0: off)."""
    value = daemon.get(KEY, DEFAULT_S)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 <= value <= MAX_S):
        raise ConfigError(f"{where}: 'daemon.{KEY}' must be a number of seconds in "
                          f"[0, {MAX_S:g}] (0 turns self-healing off), not {value!r}",
                          hint=f"for example {KEY} = {DEFAULT_S:g}, or {KEY} = 0 to keep a "
                          "plan as it is when one of its hosts dies")
    return float(value)
