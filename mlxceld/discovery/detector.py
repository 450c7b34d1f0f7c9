"""The failure detector: alive / suspect / dead per peer, a sans-IO state machine.

No IO and no clock of its own (as ``supervisor/states.py``): the heartbeat shell
(``heartbeat.py``) tells it when a peer answered a ping and what went wrong when one
did not, passes the time (a monotonic clock: a sleeping observer does not count its
own sleep against its peers), sleeps until ``next_deadline()`` and then calls
``handle_timer(now)``. A change of state comes back as ``Transitioned``; the shell
persists it, appends it as an event and logs it.

Silence is the time since a peer's last answer (or since it was first tracked, for
one that never answered). With the thresholds of ``config/liveness.py``::

    unknown ──answered──────────────────────────────▶ alive ◀──answered── suspect, dead
    unknown, alive ──silent for suspect_after_s───▶ suspect
    suspect ──silent for dead_after_s─────────────▶ dead

``dead_after_s`` counts from the last answer too, not from the suspicion. A timer
handled late (a busy loop) still passes through suspect on its way to dead: each
transition is reported, in order. A peer taken over from the state database
(``track(..., state)``) keeps its state, and its silence counts from ``now``: a
peer dead before a restart stays dead until it answers. Any answer makes a peer alive
again, with no operator action. The whole machine is ``_TRANSITIONS``; an event with
no row for the current state changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from mlxceld.config.liveness import LivenessConfig
from mlxceld.state.liveness import LivenessState

Input = Literal["answered", "suspect_silence", "dead_silence"]

_TRANSITIONS: Final[dict[tuple[LivenessState, Input], LivenessState]] = {
    ("unknown", "answered"): "alive",
    ("suspect", "answered"): "alive",
    ("dead", "answered"): "alive",
    ("unknown", "suspect_silence"): "suspect",
    ("alive", "suspect_silence"): "suspect",
    ("suspect", "dead_silence"): "dead",
}


@dataclass(frozen=True)
class Transitioned:
    address: str
    old: LivenessState
    new: LivenessState
    reason: str
    at: float  # the detector's clock


@dataclass
class _Peer:
    state: LivenessState
    silent_from: float  # the last answer, or when tracking began
    answered_ever: bool = False
    error: str | None = None  # the last failure the shell reported


class Detector:
    def __init__(self, thresholds: LivenessConfig) -> None:
        self._t = thresholds
        self._peers: dict[str, _Peer] = {}

    @property
    def thresholds(self) -> LivenessConfig:
        return self._t

    def addresses(self) -> list[str]:
        return sorted(self._peers)

    def state(self, address: str) -> LivenessState | None:
        peer = self._peers.get(address)
        return peer.state if peer else None

    def track(self, address: str, now: float, state: LivenessState = "unknown") -> None:
        """Watch ``address`` from ``now`` on, in ``state`` (what the database says)."""
        if address not in self._peers:
            self._peers[address] = _Peer(state, now)

    def forget(self, address: str) -> None:
        self._peers.pop(address, None)

    def answered(self, address: str, now: float) -> list[Transitioned]:
        """``address`` answered a ping at ``now``."""
        peer = self._peers.get(address)
        if peer is None:
            return []
        silence = now - peer.silent_from
        peer.silent_from, peer.error, peer.answered_ever = now, None, True
        reason = ("answered a ping" if peer.state == "unknown" else
                  f"answered again after {silence:.1f} s without an answer")
        return self._step(address, peer, "answered", reason, now)

    def failed(self, address: str, error: str) -> None:
        """A ping or a dial of ``address`` failed (``error``: why, for the reasons)."""
        peer = self._peers.get(address)
        if peer is not None:
            peer.error = error

    def next_deadline(self) -> float | None:
        """When ``handle_timer`` has something to do; None: nothing to wait for."""
        deadlines = [d for peer in self._peers.values() if (d := self._due(peer)) is not None]
        return min(deadlines, default=None)

    def handle_timer(self, now: float) -> list[Transitioned]:
        out: list[Transitioned] = []
        for address in sorted(self._peers):
            peer = self._peers[address]
            while (due := self._due(peer)) is not None and due <= now:
                out += self._silent(address, peer)
        return out

    # -- the machine ---------------------------------------------------------------------

    def _due(self, peer: _Peer) -> float | None:
        if peer.state in ("unknown", "alive"):
            return peer.silent_from + self._t.suspect_after_s
        if peer.state == "suspect":
            return peer.silent_from + self._t.dead_after_s
        return None  # dead: only an answer changes it

    def _silent(self, address: str, peer: _Peer) -> list[Transitioned]:
        t = self._t
        if peer.state == "suspect":
            event: Input = "dead_silence"
            at, limit = peer.silent_from + t.dead_after_s, t.dead_after_s
        else:
            event = "suspect_silence"
            at, limit = peer.silent_from + t.suspect_after_s, t.suspect_after_s
        never = "" if peer.answered_ever else " (none since this daemon began watching it)"
        reason = (f"no answer to pings for {limit:g} s{never}"
                  + (f"; last error: {peer.error}" if peer.error else ""))
        return self._step(address, peer, event, reason, at)

    @staticmethod
    def _step(address: str, peer: _Peer, event: Input, reason: str,
              now: float) -> list[Transitioned]:
        new = _TRANSITIONS.get((peer.state, event))
        if new is None:
            return []
        old, peer.state = peer.state, new
        return [Transitioned(address, old, new, reason, now)]
