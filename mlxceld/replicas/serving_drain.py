"""An operator's drain of a serving node's listener (``service.py``'s ``drain``): what it
holds, and its deadline's timer.

`mlxctl drain` of the node reaches its worker as a ``drain`` op with a deadline (unix
seconds, or none); ``begin`` says it, again and again while it lasts (the same deadline
changes nothing, another moves the timer), and ``end`` is the undrain. While ``active``,
the listener refuses new sequences with ``draining``; at the deadline ``on_deadline``
runs once (the service ends the sequences still held). ``left`` and ``ended`` count the
sequences that ended since the drain began, and those its deadline ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class OperatorDrain:
    """A serving listener's drain (see the module doc)."""

    node_id: str
    active: bool = False
    deadline: float | None = None
    timer: asyncio.TimerHandle | None = None
    expired: bool = False  # the deadline passed
    left: int = 0  # sequences that ended while it drained
    ended: int = 0  # of which ended by its deadline

    def begin(self, deadline: float | None, on_deadline: Callable[[], None]) -> None:
        """Drain until ``end``; at ``deadline`` (None: none) ``on_deadline`` runs."""
        if not self.active:
            self.active, self.left, self.ended = True, 0, 0
            log.info("node %s is draining: its serving listener takes no new sequence",
                     self.node_id)
        if self.deadline == deadline and (self.timer is not None or deadline is None
                                          or self.expired):
            return
        self.disarm()
        self.deadline, self.expired = deadline, False
        if deadline is not None:
            delay = max(0.0, deadline - time.time())
            self.timer = asyncio.get_running_loop().call_later(delay, self._expire,
                                                               on_deadline)

    def end(self) -> None:
        """The undrain: admit again."""
        if self.active:
            log.info("node %s undrained: its serving listener admits again", self.node_id)
        self.disarm()
        self.active, self.deadline, self.expired = False, None, False

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self, on_deadline: Callable[[], None]) -> None:
        self.timer, self.expired = None, True
        on_deadline()


__all__ = ["OperatorDrain"]
