"""The listener's pending pool: sockets accepted and not yet authenticated.

PROTOCOL.md section 2 bounds it: ``max_total`` (64) in flight, ``max_per_source``
(8) from one source (an IPv4 address or an IPv6 /64). ``admit`` keeps both bounds
for every socket accepted, and decides which socket is closed at accept when a
bound is reached. The rule: what a source does before authenticating costs that
source, never another one.

- The newcomer's source is at its bound: it gives up its own oldest socket, a
  *silent* one (its ClientHello not complete) if it has one, else its oldest one
  that sent a hello and has not finished the handshake. The newcomer takes its slot.
- The pool is at its bound: the socket closed is taken from the source holding the
  most pending sockets (a tie: the source holding the oldest socket), its oldest
  silent one if any, else its oldest; never the only socket of the newcomer's own
  source (a peer's second dial does not end its first).
- With nothing to close under that rule (a bound of 1), the newcomer is refused.

Whether a socket has sent its hello does not protect it: the cluster's key id is
public (in every hello and in the mDNS record), so a complete hello that then
stalls is as cheap to send as silence, and would hold its slot for the whole
handshake bound (5 s). What protects a keyed peer is that it holds one pending
socket per dial, for one network trip, while a flood must hold many to fill the
pool: with fewer than 64 sources some flooding source holds more than one socket
and gives up its own first, refills included; with 64 sources or more, sources
holding one socket each lose the oldest first, and the peer's is the newest. Either
way the flood's sockets go before the peer's, and the peer finishes its handshake.
This module does no IO and reads
no clock: the listener closes what is evicted or refused.
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
        """Take ``entry`` in, closing another socket if a bound is reached (see above)."""
        victim: Pending | None = None
        if self._counts[entry.bucket] >= self.max_per_source:
            victim = self._oldest_of(entry.bucket) if self._counts[entry.bucket] > 1 else None
            if victim is None:
                return Admission(False, refusal=f"pending pool full for source {entry.bucket} "
                                                f"({self.max_per_source})")
        elif len(self._entries) >= self.max_total:
            busiest = self._busiest(sparing=entry.bucket)
            victim = None if busiest is None else self._oldest_of(busiest)
            if victim is None:
                return Admission(False, refusal=f"pending pool full ({self.max_total})")
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

    def _busiest(self, sparing: str) -> str | None:
        """The source holding the most pending sockets (a tie: the one holding the oldest),
        ``sparing``'s lone socket left out."""
        best: str | None = None
        for e in self._entries:  # oldest first: a tie keeps the older one
            if e.bucket == sparing and self._counts[sparing] < 2:
                continue
            if best is None or self._counts[e.bucket] > self._counts[best]:
                best = e.bucket
        return best

    def _oldest_of(self, bucket: str) -> Pending | None:
        """``bucket``'s oldest silent socket, else its oldest."""
        oldest: Pending | None = None
        for e in self._entries:
            if e.bucket == bucket:
                if e.silent:
                    return e
                oldest = oldest or e
        return oldest
