"""A stage link's connectivity, sans-IO: its state, why it is down, when to re-dial.

The link (links.py) feeds it what happened (attached, an attempt failed, the
connection was lost) with the wall-clock time; it answers with a ``Transition``
when the state changed, which the link logs once, and nothing while the same
failure repeats: a stage that stays down is one line in the log, not one per
retry. ``next_delay`` is the bounded backoff between background re-dials:
``RETRY_INITIAL_S`` doubling to ``RETRY_MAX_S``, back to the start once attached.

States::

    connecting ──attached──▶ attached ──lost──▶ disconnected
        │                     ▲    │                │
        │                     │    └──silent──▶ silent ◀─┐ (failed: unreachable)
        │                     │                   │      │
        └──failed──▶ unreachable | refused | standby | model_mismatch | layers_mismatch
                     | failed           (each retried until attached)

``failed``: the stage failed on its host and is not restarted until fixed: its
daemon's stand-in answered for it (``standin.py``), and ``error`` is what it said
(the stage, the node, the reason, the next step).

``silent``: the attached stage stopped answering (no byte, not even a pong, for the
link's silence bound; ``mlxceld.net.liveness``): its host sleeps or is off the
network. It stays silent while re-dials find nobody answering (``unreachable``),
since when it went silent, and leaves only when attached again, or for a failure
that says more (refused, a mismatch). While silent, ``admits`` is False: requests
are refused at once rather than each waiting for a dial to a sleeping host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

RETRY_INITIAL_S: Final = 0.5
RETRY_MAX_S: Final = 5.0

LinkState = Literal["connecting", "attached", "disconnected", "unreachable", "refused",
                    "standby", "model_mismatch", "layers_mismatch", "failed", "silent"]
Failure = Literal["unreachable", "refused", "standby", "model_mismatch", "layers_mismatch",
                  "failed"]
FAILURES: Final[frozenset[str]] = frozenset(
    {"unreachable", "refused", "standby", "model_mismatch", "layers_mismatch", "failed"})


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

    @property
    def admits(self) -> bool:
        """Whether a request may dial this link on demand (not while it is silent)."""
        return self.state != "silent"

    def attached(self, now: float) -> Transition | None:
        self._delay, self.failures = self._initial, 0
        return self._move("attached", None, now)

    def failed(self, failure: Failure, error: str, now: float) -> Transition | None:
        """An attempt to dial and attach failed; the message replaces the last one."""
        if failure not in FAILURES:
            raise ValueError(f"unknown link failure {failure!r}; expected one of "
                             f"{sorted(FAILURES)}")
        self.failures += 1
        if self.state == "silent" and failure == "unreachable":
            return self._move("silent", error, now)  # still nobody answers: still silent
        return self._move(failure, error, now)

    def lost(self, reason: str, now: float) -> Transition | None:
        """The attached connection ended; re-dialing starts over at the shortest delay."""
        self._delay = self._initial
        return self._move("disconnected", reason, now)

    def silent(self, reason: str, now: float) -> Transition | None:
        """The attached stage answered nothing for the silence bound; re-dialing starts
        over at the shortest delay."""
        self._delay = self._initial
        return self._move("silent", reason, now)

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
