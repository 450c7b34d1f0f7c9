"""Handoffs a decode node holds for a moment (``handoffs.py``): the rule, without IO.

A prefill node's ``handoff`` and the router's ``expect`` for the same sequence reach
the decode node over two connections, so the handoff may come first (the router sends
its ``expect`` before its ``prefill``, but each connection is read on its own). And a
prefill node that just restarted serves at a new address that the decode node learns
from its agent only at its next ask (``workers/handoff_node.py``'s ``PrefillPeers``).
Either way the frames are held here instead of dropped:

- an *early* handoff (no ``expect`` yet) waits for its ``expect``;
- a handoff from an address that is not a prefill peer *yet*, for a sequence whose
  ``expect`` names that address, waits for the decode node to ask its peers' agents
  again (at once, not at the next ``PEERS_EVERY_S``); still no peer then, its sequence
  ends at once (``fail``), as does an ``expect`` whose frames were let go before it.

Bounds: a sequence's frames are held at most ``HOLD_S`` from its first one; at most
``SEQUENCES`` sequences are held at once, their frames ``BYTES`` together; a frame past
either bound is refused (its sequence's held frames with it). A sequence whose frames
were let go (``drop``) is remembered, the last ``REMEMBERED`` of them, so that its later
frames are refused at once and its late ``expect`` fails at once, saying why.
``HeldHandoffs`` is the rule, its times the caller's clock (``now``); ``EarlyHandoffs``
is the node's asyncio shell around it (its timer, its asks of the peers' agents).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from mlxceld.replicas.protocol import HANDOFF_FRAME_BYTES
from mlxceld.wire import Envelope

log = logging.getLogger(__name__)

HOLD_S: Final = 3.0  # a sequence's frames wait this long, from the first, at most
SEQUENCES: Final = 16  # sequences held at once
BYTES: Final = 2 * HANDOFF_FRAME_BYTES  # the held frames' blobs, together
REMEMBERED: Final = 256  # sequences let go, remembered with why


@dataclass
class Held:
    """One sequence's held frames, in the order they came."""

    peer: str  # the identity they came from (the handshake's)
    since: float
    asked: int  # the peers' asks started before it was held (see ``HeldHandoffs.asks``)
    frames: list[Envelope] = field(default_factory=list)
    size: int = 0


class HeldHandoffs:
    def __init__(self, *, hold_s: float = HOLD_S, sequences: int = SEQUENCES,
                 max_bytes: int = BYTES) -> None:
        self.hold_s = hold_s
        self._sequences = sequences
        self._max_bytes = max_bytes
        self._held: dict[str, Held] = {}
        self._size = 0
        self._gone: OrderedDict[str, str] = OrderedDict()  # seq -> why it was let go
        self.asks = 0  # the peers' asks started so far (the caller counts them)

    def __contains__(self, seq: object) -> bool:
        return seq in self._held

    def __len__(self) -> int:
        return len(self._held)

    def seqs(self) -> list[str]:
        return list(self._held)

    def get(self, seq: str) -> Held | None:
        return self._held.get(seq)

    def gone(self, seq: str) -> str | None:
        """Why ``seq``'s frames were let go, if they were (and not long ago)."""
        return self._gone.get(seq)

    def hold(self, seq: str, peer: str, env: Envelope, now: float) -> str | None:
        """Hold ``env`` (a frame of ``seq`` from ``peer``); None when held, else why not
        (the sequence's frames held before are let go with it: ``drop``)."""
        why = self._gone.get(seq)
        if why is not None:
            return why
        held = self._held.get(seq)
        if held is not None and held.peer != peer:
            return "another node sends frames of that sequence"
        if held is None and len(self._held) >= self._sequences:
            return self.drop(seq, f"{self._sequences} sequences' handoffs are held already "
                             "for their router's expect")
        size = sum(len(t.data) for t in env.tensors.values())
        if self._size + size > self._max_bytes:
            return self.drop(seq, f"the handoffs held for their router's expect would pass "
                             f"{self._max_bytes} bytes")
        if held is None:
            held = self._held[seq] = Held(peer, now, self.asks)
        held.frames.append(env)
        held.size += size
        self._size += size
        return None

    def take(self, seq: str) -> Held | None:
        """``seq``'s held frames, no longer held (None: none are)."""
        held = self._held.pop(seq, None)
        if held is not None:
            self._size -= held.size
        return held

    def drop(self, seq: str, why: str) -> str:
        """Let ``seq``'s frames go and remember why; ``why``."""
        self.take(seq)
        self._gone[seq] = why
        self._gone.move_to_end(seq)
        while len(self._gone) > REMEMBERED:
            self._gone.popitem(last=False)
        return why

    def expired(self, now: float) -> list[str]:
        """The sequences held ``hold_s`` or longer."""
        return [seq for seq, held in self._held.items() if now - held.since >= self.hold_s]

    def next_deadline(self) -> float | None:
        return min((h.since + self.hold_s for h in self._held.values()), default=None)




class EarlyHandoffs:
    """A decode node's shell around ``HeldHandoffs``: its expiry timer and its asks of the
    prefill peers' agents. Told by the node: ``hold`` (a frame to hold), ``expected`` (an
    ``expect`` came); it calls back: ``known(peer)`` (a prefill peer now?),
    ``expects(seq)``, ``deliver(seq, peer, env, known)`` (take or drop a frame as if it
    came now), ``fail(seq, why)`` (end an expected sequence), ``dropped(peer, why)`` (a
    frame let go: counted and logged), ``recheck()`` (ask the peers' agents again; None:
    never), ``spawn`` (runs an ask in the node's background)."""

    def __init__(self, rule: HeldHandoffs, *, known: Callable[[str], bool],
                 expects: Callable[[str], bool],
                 deliver: Callable[[str, str, Envelope, bool], None],
                 fail: Callable[[str, str], None], dropped: Callable[[str, str], None],
                 recheck: Callable[[], Awaitable[None]] | None,
                 spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self.rule = rule
        self._known, self._expects, self._deliver = known, expects, deliver
        self._fail, self._dropped = fail, dropped
        self._recheck, self._spawn = recheck, spawn
        self._timer: asyncio.TimerHandle | None = None  # the oldest held frames' expiry
        self._asking = False  # the peers' agents are being asked
        self._asked = 0  # the asks (``rule.asks``) answered so far

    def __contains__(self, seq: object) -> bool:
        return seq in self.rule

    def hold(self, seq: str, peer: str, env: Envelope) -> None:
        loop = asyncio.get_running_loop()
        why = self.rule.hold(seq, peer, env, loop.time())
        if why is not None:
            self._fail(seq, why)
            self._dropped(peer, why)
            return
        if self._timer is None:
            self._arm()
        self._release(seq)

    def expected(self, seq: str) -> None:
        """``seq``'s expect came: its held frames go on (or it fails at once, when they
        were let go before it came)."""
        gone = self.rule.gone(seq)
        if gone is not None:
            self._fail(seq, gone)
        self._release(seq)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self, seq: str) -> None:
        """Hand ``seq``'s held frames on once its expect came and their sender is a peer,
        or was asked about since they came (else they wait on)."""
        held = self.rule.get(seq)
        if held is None or not self._expects(seq):
            return
        known = self._known(held.peer)
        if not known and held.asked >= self._asked:
            if held.asked == self.rule.asks:
                self._ask()  # the first expected frame from that address: ask about it
            if held.asked >= self._asked:
                return  # the peers' agents are being asked: wait for their answers
        self.rule.take(seq)
        for env in held.frames:
            self._deliver(seq, held.peer, env, known)

    def _arm(self) -> None:
        deadline = self.rule.next_deadline()
        if deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        """Let the frames held ``hold_s`` go, each with a log line (``dropped``)."""
        self._timer = None
        hold_s = self.rule.hold_s
        for seq in self.rule.expired(asyncio.get_running_loop().time()):
            held = self.rule.get(seq)
            assert held is not None
            if self._expects(seq):
                why = (f"held {hold_s:g} s, and the agents of this node's prefill peers "
                       "did not name that address")
            elif self._known(held.peer):
                why = f"held {hold_s:g} s, and no router's expect for it came"
            else:
                why = (f"it is not one of this node's prefill peers (held {hold_s:g} s: no "
                       "router's expect for it came)")
            self.rule.drop(seq, why)
            self._fail(seq, why)
            self._dropped(held.peer, why)
        self._arm()

    def _ask(self) -> None:
        """Ask the peers' agents again now: one ask at a time, another after it when a
        frame was held meanwhile; then hand on what that lets through."""
        self.rule.asks += 1
        recheck = self._recheck
        if recheck is None:  # nobody to ask: as if asked, with the same answer
            self._asked = self.rule.asks
            return
        if self._asking:
            return
        self._asking = True

        async def ask() -> None:
            try:
                while self._asked < self.rule.asks:
                    upto = self.rule.asks
                    try:
                        async with asyncio.timeout(self.rule.hold_s):
                            await recheck()
                    except TimeoutError:
                        pass  # as answered: what is known now is all there is
                    except Exception as exc:  # the same, and said
                        log.warning("asking the prefill peers' agents again failed: %r", exc)
                    self._asked = upto
                    for seq in self.rule.seqs():
                        self._release(seq)
            finally:
                self._asking = False

        self._spawn(ask())


__all__ = ["BYTES", "HOLD_S", "REMEMBERED", "SEQUENCES", "EarlyHandoffs", "Held",
           "HeldHandoffs"]
