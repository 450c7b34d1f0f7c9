"""Telling a service manager how the daemon is doing: systemd's notification protocol.

The protocol (sd_notify(3)) is one datagram of ``KEY=VALUE`` lines sent to the
AF_UNIX socket named by ``NOTIFY_SOCKET``: a path, or an abstract-namespace
name written with a leading ``@``. Without ``NOTIFY_SOCKET`` everything here
does nothing, so launchd, ``brew services`` and a terminal see no difference.

What mlxceld sends, and when:

``READY=1``
    once the control socket is bound, the state database is open (the
    previous run's state recovered) and every surviving worker re-adopted
    or started. Readiness is the control plane's: a model goes on loading
    in the router worker after it, visible in ``STATUS=`` and
    ``mlxctl status``. Start-up never waits for a model, so the unit's
    ``TimeoutStartSec=`` never has to cover one.
``STATUS=...``
    a one-line summary, whenever it changes (looked at every
    ``STATUS_EVERY_S``); a router or stage worker that reads its weights
    reads ``router loading 43% of 61.0 GiB, 12 s`` (its load as its
    supervisor last asked it, every ``supervisor.service.LOADS_EVERY_S``).
``RELOADING=1`` with ``MONOTONIC_USEC=``, then ``READY=1``
    around a SIGHUP reload.
``STOPPING=1`` with ``EXTEND_TIMEOUT_USEC=``
    at shutdown; the extension is the drain deadline (the longest worker
    stop timeout plus the daemon's slack), so a ``TimeoutStopSec=`` shorter
    than the drain does not cut it short.
``WATCHDOG=1``
    from the event loop, every half of ``WATCHDOG_USEC`` or more often (with
    each status look), when the unit sets ``WatchdogSec=`` and
    ``WATCHDOG_PID`` is unset or is our pid.

Send errors are logged, never raised: a service manager that went away must
not stop the daemon. Workers never see these variables (the supervisor drops
them from a child's environment: only the main process may notify).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

from mlxceld.types import JSON, loading_text

log = logging.getLogger(__name__)

ENV_SOCKET, ENV_WATCHDOG_USEC, ENV_WATCHDOG_PID = "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"
STATUS_EVERY_S = 2.0


def notify_address(value: str) -> str | None:
    """``NOTIFY_SOCKET`` as an address for ``sendto``: ``@name`` is the abstract namespace.

    Other forms (``vsock:``, relative paths) are not supported: ``None``.
    """
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WATCHDOG_USEC``), or ``None``."""
    try:
        usec = int(environ.get(ENV_WATCHDOG_USEC, ""))
    except ValueError:
        return None
    owner = environ.get(ENV_WATCHDOG_PID)
    if usec <= 0 or (owner and owner.strip() != str(pid)):
        return None
    return usec / 2 / 1_000_000


def status_line(status: JSON) -> str:
    """One line for ``STATUS=`` from the daemon's status: what it serves, how its workers are."""
    if status["daemon"]["state"] == "stopping":
        return "stopping"
    serving = status.get("serving")
    what = (f"serving {serving['model_name']} at {serving['url']}" if serving
            else "idle (no model)")
    workers = status["workers"]
    now = time.time()
    states = ", ".join(f"{w['name']} " + (loading_text(w["loading"], now) if w.get("loading")
                                          else w["state"]) for w in workers) or "none"
    problems = len(status["problems"])
    tail = f"; {problems} problem(s), see mlxctl status" if problems else ""
    return f"{what}; workers: {states}{tail}"


def _usec(seconds: float) -> int:
    return max(1, round(seconds * 1_000_000))


class Notifier:
    """The daemon's side of the protocol; ``from_environment`` reads the variables."""

    def __init__(self, address: str | None, watchdog_s: float | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s if address is not None else None
        self._sock: socket.socket | None = None
        self._closed = asyncio.Event()
        self._warned = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None,
                         pid: int | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_SOCKET, "")
        address = notify_address(raw) if raw else None
        if raw and address is None:
            log.warning("NOTIFY_SOCKET=%r is not a path or an @abstract name; "
                        "not notifying the service manager", raw)
        watchdog = watchdog_interval(env, os.getpid() if pid is None else pid)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str) -> bool:
        """One datagram of ``KEY=VALUE`` lines; True if it was sent."""
        if self.address is None:
            return False
        data = "".join(f"{k}={v.replace(chr(10), ' ')}\n" for k, v in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX,
                                           socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(data.encode(), self.address)
        except OSError as exc:
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "cannot notify the service manager at %s: %s",
                    os.environ.get(ENV_SOCKET) or self.address.replace("\0", "@"), exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY="1", STATUS=status)

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(RELOADING="1", MONOTONIC_USEC=str(usec), STATUS="reloading")

    def stopping(self, drain_s: float, workers: int) -> bool:
        return self.send(STOPPING="1", EXTEND_TIMEOUT_USEC=str(_usec(drain_s)),
                         STATUS=f"stopping {workers} worker(s), at most {drain_s:.0f} s")

    async def run(self, status: Callable[[], str]) -> None:
        """Until ``close``: ``STATUS=`` on change, ``WATCHDOG=1`` at least at half the interval."""
        if self.address is None:
            return
        step = min(STATUS_EVERY_S, self.watchdog_s or STATUS_EVERY_S)
        last, failed = "", False
        while not self._closed.is_set():
            fields = {"WATCHDOG": "1"} if self.watchdog_s else {}
            line: str | None = None
            try:
                line = status()
            except Exception as exc:  # a summary that fails must not end the daemon
                log.log(logging.DEBUG if failed else logging.WARNING,
                        "no STATUS= for the service manager: %s: %s", type(exc).__name__, exc)
                failed = True
            if line is not None and line != last:
                fields["STATUS"] = last = line
            if fields:
                self.send(**fields)
            try:
                async with asyncio.timeout(step):
                    await self._closed.wait()
            except TimeoutError:
                pass

    def close(self) -> None:
        """End ``run``; the socket is closed too (later sends open it again)."""
        self._closed.set()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
