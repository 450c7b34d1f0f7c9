"""Noticing a peer that went silent: heartbeats on a stream, and TCP keepalive on its socket.

A host that sleeps or loses its cable sends no RST: its socket stays open, writes
are buffered, reads wait forever. Only our own clock can tell. Three layers:

- ``watch(stream, silence_s)``: the heartbeat. It pings the peer (PROTOCOL.md: every
  listener answers ``ping`` with ``pong``) every ``silence_s / PINGS_PER_SILENCE`` while
  nothing else arrives, and ends the stream (``ConnectionClosed`` kind ``"silent"``,
  the socket aborted) once nothing at all has been heard for ``silence_s``: the
  stream's reader and every writer blocked on it wake at once. The peer is noticed
  ``silence_s`` after the last byte it sent, whatever the traffic. In the bound's last
  ``GRACE_S`` it lets the reader take what the socket holds before it blames the peer
  (our own loop may have been the one stalled); a stall of our own longer than
  ``silence_s`` with nothing in flight still reads as the peer's silence (the link is
  re-dialed).
- the write deadline of ``MxclStream.send`` (``stream.WRITE_TIMEOUT_S``): a write
  the peer does not take ends the stream rather than blocking its sender.
- TCP keepalive (``keep_alive_socket``, on every dialed and accepted socket): a
  backstop for a stream without a heartbeat; the kernel probes after
  ``KEEPALIVE_IDLE_S`` idle, every ``KEEPALIVE_INTERVAL_S``, and resets the
  connection after ``KEEPALIVE_COUNT`` probes unanswered (about 16 s). It cannot
  see a stopped process whose kernel still answers (SIGSTOP): the heartbeat does.

``read_watched`` reads a stream with its heartbeat beside. ``Heartbeat`` is the rule,
without IO: it is fed the time and what was heard, and
says when to ping and whether the peer is silent.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from mlxceld.net.errors import ConnectionClosed

if TYPE_CHECKING:
    from mlxceld.net.stream import MxclStream

log = logging.getLogger(__name__)

PINGS_PER_SILENCE: Final = 3  # pings sent within one silence_s while nothing comes
GRACE_S: Final = 0.02  # at the bound, the reader's last chance to take what is unread
KEEPALIVE_IDLE_S: Final = 10
KEEPALIVE_INTERVAL_S: Final = 2
KEEPALIVE_COUNT: Final = 3


@dataclass
class Heartbeat:
    """When to ping and when the peer is silent; times are the loop's clock."""

    silence_s: float
    heard_at: float  # the last time the peer sent anything
    pinged_at: float  # the last ping we sent (the start, before any)

    def __post_init__(self) -> None:
        if not 0 < self.silence_s < float("inf"):
            raise ValueError(f"silence_s must be a number of seconds above 0, not "
                             f"{self.silence_s!r}")

    @property
    def interval_s(self) -> float:
        return self.silence_s / PINGS_PER_SILENCE

    def heard(self, at: float) -> None:
        self.heard_at = max(self.heard_at, at)

    def silent(self, now: float) -> bool:
        return now - self.heard_at >= self.silence_s

    def ping_due(self, now: float) -> bool:
        """A ping is due once ``interval_s`` passed with neither a ping nor a word."""
        return now - max(self.heard_at, self.pinged_at) >= self.interval_s

    def pinged(self, now: float) -> None:
        self.pinged_at = now

    def next_wake(self) -> float:
        """The earliest time something may change: a ping due, or the silence reached."""
        return min(max(self.heard_at, self.pinged_at) + self.interval_s,
                   self.heard_at + self.silence_s)


async def watch(stream: MxclStream, silence_s: float, what: str) -> None:
    """Ping ``stream``'s peer while it is quiet; end the stream when it has been silent
    for ``silence_s`` (``what``: the peer in the log line, "stage stage-1"; the stream's
    ``ConnectionClosed`` says why without naming it, for its owner to name it).
    Returns when the stream ends, by this or anything else; cancel it to stop early."""
    loop = asyncio.get_running_loop()
    grace = min(GRACE_S, silence_s / 10)  # taken from the bound, not added to it
    beat = Heartbeat(silence_s - grace, stream.heard_at, loop.time())
    while not stream.closed:
        now = loop.time()
        beat.heard(stream.heard_at)
        if beat.silent(now):
            # Our own loop may have stalled with the peer's answer unread: let the reader
            # take what the socket holds before blaming the peer.
            await asyncio.sleep(grace)
            beat.heard(stream.heard_at)
            if not beat.silent(now):
                continue
            now = loop.time()
            reason = (f"nothing heard for {now - beat.heard_at:.1f} s (the bound is "
                      f"{silence_s:g} s): the host may be asleep or off the network")
            log.warning("%s is silent: nothing heard from %s for %.2f s; the connection is "
                        "dropped", what, stream.peer, now - beat.heard_at)
            await stream.silenced(reason)
            return
        if beat.ping_due(now):
            beat.pinged(now)
            stream.ping()
        await asyncio.sleep(max(0.0, beat.next_wake() - loop.time()))


async def read_watched(stream: MxclStream, silence_s: float, what: str,
                       on_message: Callable[[bytes], None]) -> ConnectionClosed:
    """Hand each of ``stream``'s messages to ``on_message`` until the stream ends, with a
    heartbeat beside (``watch``: a silent peer's stream is ended); why it ended."""
    async with asyncio.TaskGroup() as tg:
        heartbeat = tg.create_task(watch(stream, silence_s, what))
        try:
            while True:
                on_message(await stream.recv())
        except ConnectionClosed as exc:
            heartbeat.cancel()
            return exc


def keep_alive_socket(sock: socket.socket | None) -> None:
    """Turn on TCP keepalive with this module's timings (where the platform has them)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)
        for option, value in ((idle, KEEPALIVE_IDLE_S),
                              (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
                              (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_COUNT)):
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    except OSError as exc:  # a socket already reset: the stream notices by itself
        log.debug("could not set TCP keepalive: %s", exc)
