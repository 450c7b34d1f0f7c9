"""A stage's two connections onward, each a ``Redialer`` dialed as the stage's own
listener address: ``down``, to the next stage (its activations, ``act``), and ``ring``,
from the last stage of two or more to the first (``next``: a sampled token to run as the
next decode step). A stage that has no such neighbour holds a ``Redialer`` whose target
is None, never dialed.

Each is dialed at its first send within ``DOWNSTREAM_DIAL_S`` and kept up by its own
reader (``run``); the stage they lead to answers nothing, so anything it sends is logged
and dropped. A send that fails (``send``) drops the connection, so the next send dials
afresh, and says why, naming the neighbour and its address. When the keyring's primary
changes (``rekey``), both are handed over to streams under the new key in the background
(``Redialer.hand_over``); one that cannot dial stays on its old key until that key is
removed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Final

from mlxceld.net import ConnectionClosed, Redialer
from mlxceld.net.errors import NetError
from mlxceld.wire import Keyring
from mlxceld.wire.address import HostPort

log = logging.getLogger(__name__)

DOWNSTREAM_DIAL_S: Final = 5.0


class Onward:
    def __init__(self, node_id: str, keyring: Keyring, me: HostPort,
                 downstream: tuple[str, int] | None, first: tuple[str, int] | None,
                 silence_s: float) -> None:
        self._node_id = node_id
        self.down = _redialer(downstream, keyring, me, "next stage", silence_s)
        self.ring = _redialer(first, keyring, me, "first stage", silence_s)
        self._rekeyed = asyncio.Event()

    async def run(self) -> None:
        """Read both connections and carry out the handovers, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.down.run())
            tg.create_task(self.ring.run())
            tg.create_task(self._hand_over())

    async def send(self, dialer: Redialer, message: bytes) -> str | None:
        """``message`` over ``dialer`` (``down`` or ``ring``): None once sent, else why it
        could not be (the connection is dropped: the next send dials afresh)."""
        try:
            await dialer.send(message)
        except (ConnectionClosed, NetError) as exc:
            dialer.forget()
            return f"cannot reach the {dialer.what} at {_addr(dialer.target)}: {exc}"
        return None

    def rekey(self) -> None:
        """The keyring's primary changed: hand both connections over to it."""
        self._rekeyed.set()

    async def _hand_over(self) -> None:
        while True:
            await self._rekeyed.wait()
            self._rekeyed.clear()
            for dialer in (self.down, self.ring):
                if dialer.target is None:
                    continue
                try:
                    await dialer.hand_over()
                except NetError as exc:
                    log.warning("stage %s: the %s stays on its old key for now: %s",
                                self._node_id, dialer.what, exc)

    def rtts_ms(self) -> dict[str, float | None]:
        """Each connection that has a neighbour (``next``: the next stage, ``first``: the
        first stage, from the last): its latest heartbeat's round trip in ms, or None."""
        return {name: None if d.rtt_s is None else round(d.rtt_s * 1000, 3)
                for name, d in (("next", self.down), ("first", self.ring))
                if d.target is not None}

    async def aclose(self, why: str) -> None:
        await self.down.aclose(why)
        await self.ring.aclose(why)


def _redialer(target: tuple[str, int] | None, keyring: Keyring, me: HostPort,
              what: str, silence_s: float) -> Redialer:
    return Redialer(target, keyring=keyring, origin=me, channel=1, what=what,
                    budget_s=DOWNSTREAM_DIAL_S, on_message=functools.partial(_unexpected, what),
                    silence_s=silence_s)


def _unexpected(what: str, payload: bytes) -> None:
    """What the next (or first) stage sends us: it answers nothing, only refuses."""
    log.warning("the %s sent %d unexpected bytes (%r...)", what, len(payload),
                bytes(payload[:120]))


def _addr(hp: tuple[str, int] | None) -> str:
    return "-" if hp is None else f"{hp[0]}:{hp[1]}"
