"""A stage link's connectivity, sans-IO: its state, why it is down, when to re-dial.

The link (links.py) feeds it what happened (attached, an attempt failed, the
connection was lost) with the wall-clock time; it answers with a ``Transition``
when the state changed, which the link logs once, and nothing while the same
failure repeats: a stage that stays down is one line in the log, not one per
retry. ``next_delay`` is the bounded backoff between background re-dials:
``RETRY_INITIAL_S`` doubling to ``RETRY_MAX_S``, back to the start once attached.

States::

    connecting ──attached──▶ attached ──lost──▶ disconnected
        │                       ▲                   │
        └──failed──▶ unreachable | refused | standby | model_mismatch | layers_mismatch
                                (each retried until attached)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

RETRY_INITIAL_S: Final = 0.5
RETRY_MAX_S: Final = 5.0

LinkState = Literal["connecting", "attached", "disconnected", "unreachable", "refused",
                    "standby", "model_mismatch", "layers_mismatch"]
Failure = Literal["unreachable", "refused", "standby", "model_mismatch", "layers_mismatch"]
FAILURES: Final[frozenset[str]] = frozenset(
    {"unreachable", "refused", "standby", "model_mismatch", "layers_mismatch"})


@dataclass(frozen=True)
class Transition:
    """The link went from ``old`` to ``new``; ``reason`` says why (None when it attached)."""

    old: LinkState
    new: LinkState
    reason: str | None


class Connectivity:
    def __init__(self, *, initial_s: float = RETRY_INITIAL_S,
                 max_s: float = RETRY_MAX_S) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, not {initial_s} and {max_s}")
        self._initial = initial_s
        self._max = max_s
        self._delay = initial_s
        self.state: LinkState = "connecting"
        self.error: str | None = None  # why it is not attached (the last failure's message)
        self.since: float | None = None  # when the state last changed (wall clock)
        self.failures = 0  # attempts failed in a row

    @property
    def up(self) -> bool:
        return self.state == "attached"

    def attached(self, now: float) -> Transition | None:
        self._delay, self.failures = self._initial, 0
        return self._move("attached", None, now)

    def failed(self, failure: Failure, error: str, now: float) -> Transition | None:
        """An attempt to dial and attach failed; the message replaces the last one."""
        if failure not in FAILURES:
            raise ValueError(f"unknown link failure {failure!r}; expected one of "
                             f"{sorted(FAILURES)}")
        self.failures += 1
        return self._move(failure, error, now)

    def lost(self, reason: str, now: float) -> Transition | None:
        """The attached connection ended; re-dialing starts over at the shortest delay."""
        self._delay = self._initial
        return self._move("disconnected", reason, now)

    def next_delay(self) -> float:
        """How long to wait before the next background attempt (doubles each call)."""
        delay = self._delay
        self._delay = min(self._delay * 2, self._max)
        return delay

    def _move(self, new: LinkState, error: str | None, now: float) -> Transition | None:
        old, self.error = self.state, error
        if new == old:
            return None
        self.state, self.since = new, now
        return Transition(old, new, error)
