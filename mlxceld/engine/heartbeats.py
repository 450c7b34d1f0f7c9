"""A tensor-parallel group's heartbeats (``tensor.py``): each follower rank says it is
alive on its op link to rank 0, and rank 0 names a rank that went silent.

A rank stopped with SIGSTOP, or hung, answers nothing, and neither its process nor its
sockets end: rank 0's step then waits in the ring without end (each step's collectives
need every rank). So each follower sends one byte (``BEAT``) every ``BEAT_S`` on its op
link, from a thread of its own (mlx lets go of the GIL while it computes or waits in a
collective, so a busy rank still beats), and rank 0's watchdog, which reads those bytes,
names a rank from which nothing came for ``SILENCE_S``: the bound a pipeline gives a
silent stage (``[serve] stage_silence_s``' default, ``net/liveness.py``). A rank that
beats again is no longer silent.

``RankSilence`` is the rule, without IO: it is fed what was heard and the time, and
says which ranks went silent and which came back.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from typing import Final

SILENCE_S: Final = 3.0  # nothing heard from a rank this long: it is silent
BEAT_S: Final = 0.25  # how often a follower beats (a silence is SILENCE_S / BEAT_S beats)
BEAT: Final = b"\0"


class RankSilence:
    """Which follower ranks rank 0 has heard from lately (times: a monotonic clock)."""

    def __init__(self, ranks: Iterable[int], now: float, silence_s: float = SILENCE_S) -> None:
        self.silence_s = silence_s
        self._heard = {rank: now for rank in ranks}
        self._silent: set[int] = set()

    def heard(self, rank: int, now: float) -> None:
        if rank in self._heard:
            self._heard[rank] = max(self._heard[rank], now)

    @property
    def any_silent(self) -> bool:
        return bool(self._silent)

    def check(self, now: float) -> tuple[list[int], list[int]]:
        """The ranks silent since the last check, and those heard again since."""
        went = [r for r, at in self._heard.items()
                if now - at >= self.silence_s and r not in self._silent]
        back = [r for r in self._silent if now - self._heard[r] < self.silence_s]
        self._silent.update(went)
        self._silent.difference_update(back)
        return sorted(went), sorted(back)


def beat(link: socket.socket, every_s: float = BEAT_S) -> None:
    """A follower's heartbeat on its op link, until the link ends (a thread's target)."""
    while True:
        time.sleep(every_s)
        try:
            link.sendall(BEAT)
        except OSError:
            return


__all__ = ["BEAT", "BEAT_S", "SILENCE_S", "RankSilence", "beat"]
