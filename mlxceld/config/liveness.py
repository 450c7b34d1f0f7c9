"""The failure detector's thresholds: the [daemon] keys ``peer_ping_interval_s``,
``peer_suspect_after_s`` and ``peer_dead_after_s`` (no flags; a reload does not change
them: they take effect at the next start).

Every member pings each peer it knows (discovery's candidates and the peers of its
active plan) over the agent connection (MXCL channel 3) every ``peer_ping_interval_s``
(default 1 s). A peer that has not answered for ``peer_suspect_after_s`` (default 3 s) is
``suspect``; for ``peer_dead_after_s`` (default 10 s), ``dead``. Any answer makes it
``alive`` again (``mlxceld/discovery/detector.py``). ``peer_suspect_after_s`` is also
the agent listener's silence bound: a connected peer that sends nothing, not even a pong
to its pings, for that long has its connection dropped (``mlxceld/net/agent.py``).
The rules: each a number of seconds in (0, 3600], and ``ping interval < suspect after <
dead after``, so that at least one ping can be answered before a peer is suspected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from mlxceld.errors import ConfigError

KEYS: Final = ("peer_ping_interval_s", "peer_suspect_after_s", "peer_dead_after_s")
MAX_S: Final = 3600.0


@dataclass(frozen=True)
class LivenessConfig:
    ping_interval_s: float = 1.0
    suspect_after_s: float = 3.0
    dead_after_s: float = 10.0


DEFAULTS: Final = LivenessConfig()


def liveness_settings(daemon: Mapping[str, Any], where: str) -> LivenessConfig:
    """The Config field ``liveness`` from the [daemon] keys, checked."""
    values = {key: _seconds(daemon, key, where) for key in KEYS}
    interval, suspect, dead = (values[k] for k in KEYS)
    if not interval < suspect < dead:
        raise ConfigError(
            f"{where}: the failure detector needs 'daemon.peer_ping_interval_s' ({interval:g}) "
            f"< 'daemon.peer_suspect_after_s' ({suspect:g}) < 'daemon.peer_dead_after_s' "
            f"({dead:g})",
            hint=f"for example {DEFAULTS.ping_interval_s:g}, {DEFAULTS.suspect_after_s:g} and "
            f"{DEFAULTS.dead_after_s:g} (the defaults): a peer must get a ping before it is "
            "suspected, and be suspected before it is dead")
    return LivenessConfig(interval, suspect, dead)


def _seconds(daemon: Mapping[str, Any], key: str, where: str) -> float:
    default = getattr(DEFAULTS, key.removeprefix("peer_"))
    value = daemon.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 < value <= MAX_S):
        raise ConfigError(f"{where}: 'daemon.{key}' must be a number of seconds in "
                          f"(0, {MAX_S:g}], not {value!r}",
                          hint=f"for example {key} = {default}")
    return float(value)
