"""The listener's pending pool: sockets accepted and not yet authenticated.

PROTOCOL.md section 2 bounds it: ``max_total`` (64) in flight, ``max_per_source``
(8) from one source (an IPv4 address or an IPv6 /64). ``admit`` keeps both bounds
for every socket accepted, and decides which socket is closed at accept when a
bound is reached:

- A socket still *silent* (its ClientHello not complete) is the one to go: the
  oldest silent socket of the newcomer's source when that source is at its bound,
  else (the pool at its bound) the oldest silent socket of the source holding the
  most pending sockets. The newcomer takes its slot.
- When no pending socket is silent (every one has sent its hello: a peer holding
  the cluster's key id, or a client mid-handshake), the newcomer is refused.

So silent sockets cannot starve a keyed peer: its socket sends the hello as it
connects and is silent for one network trip at most; until then, an eviction
takes a flooding source's older sockets before it (a source of its own holds one
pending socket, a flooding source up to 8), and from then on it is no longer
silent. This module does no IO and reads no clock: the listener closes what is
evicted or refused.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from mlxceld.wire import Connection


@dataclass(eq=False)
class Pending:
    """One accepted socket in the pool (compared by identity)."""

    bucket: str  # its source
    peer: str  # "host:port", for the security log
    writer: asyncio.StreamWriter
    task: asyncio.Task[None] | None = None  # its handshake, once started
    conn: Connection | None = field(default=None, repr=False)  # once the task runs

    @property
    def silent(self) -> bool:
        """Its ClientHello is not complete yet (or its handshake has not started)."""
        return self.conn is None or self.conn.awaiting_hello


@dataclass(frozen=True)
class Admission:
    """``admit``'s answer: the newcomer is in (``evicted`` was closed to make room) or
    refused (``refusal`` says why)."""

    admitted: bool
    evicted: Pending | None = None
    refusal: str = ""


class PendingPool:
    def __init__(self, max_total: int, max_per_source: int) -> None:
        self.max_total = max_total
        self.max_per_source = max_per_source
        self._entries: dict[Pending, None] = {}  # oldest first
        self._counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, bucket: str) -> int:
        return self._counts[bucket]

    def admit(self, entry: Pending) -> Admission:
        """Take ``entry`` in, evicting a silent socket if a bound is reached (see above)."""
        victim: Pending | None = None
        if self._counts[entry.bucket] >= self.max_per_source:
            victim = next((e for e in self._entries if e.bucket == entry.bucket and e.silent),
                          None)
            if victim is None:
                return Admission(False, refusal=f"pending pool full for source {entry.bucket} "
                                                f"({self.max_per_source}), none of them silent")
        elif len(self._entries) >= self.max_total:
            victim = self._busiest_oldest_silent()
            if victim is None:
                return Admission(False, refusal=f"pending pool full ({self.max_total}), "
                                                "none of them silent")
        if victim is not None:
            self.release(victim)
        self._entries[entry] = None
        self._counts[entry.bucket] += 1
        return Admission(True, evicted=victim)

    def release(self, entry: Pending) -> None:
        """``entry`` leaves the pool (its handshake ended, or it was evicted); idempotent."""
        if entry in self._entries:
            del self._entries[entry]
            self._counts[entry.bucket] -= 1
            if self._counts[entry.bucket] <= 0:
                del self._counts[entry.bucket]

    def _busiest_oldest_silent(self) -> Pending | None:
        best: Pending | None = None
        for e in self._entries:  # oldest first: a tie keeps the older one
            if e.silent and (best is None or self._counts[e.bucket] > self._counts[best.bucket]):
                best = e
        return best
