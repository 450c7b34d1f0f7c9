"""Free TCP ports for the daemons, routers and stages a test starts.

A port is handed out from a block of this test process's own, below the kernel's ephemeral
range (``/proc/sys/net/ipv4/ip_local_port_range``), and checked bindable on ``0.0.0.0``
first:

- parallel workers (pytest-xdist's ``gwN`` of ``PYTEST_XDIST_WORKER_COUNT``) take disjoint
  blocks, so two tests running at once never get the same port;
- the kernel picks an outgoing connection's source port, and a ``bind(port 0)``, from the
  ephemeral range: none of them can take a port between the pick and the daemon's bind (as
  one did when the pick itself was a ``bind(port 0)``);
- each process walks its block from a random start, one port after the other: two runs on
  one machine rarely meet, and the check skips a port anything else holds.

The blocks start at 20000, above the product's defaults (8080, 9464, 19000, 19100-19199)
that a real daemon on this machine may hold.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

BASE = 20000
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
MIN_BLOCK = 200  # fewer ports than this a worker: back to the kernel's ephemeral ports


def _worker() -> tuple[int, int]:
    """This process's worker index and the number of workers (0 and 1 without xdist)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    return index % max(count, 1), max(count, 1)


def _span() -> tuple[int, int] | None:
    """The ports outside the ephemeral range that tests may use: below it (from BASE), else
    above it; None where neither leaves room."""
    try:
        low, high = (int(x) for x in EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low - BASE >= MIN_BLOCK:
        return BASE, low
    if 65536 - (high + 1) >= MIN_BLOCK:
        return high + 1, 65536
    return None


def _block() -> range | None:
    span = _span()
    if span is None:
        return None
    index, count = _worker()
    size = (span[1] - span[0]) // count
    if size < MIN_BLOCK:
        return None
    return range(span[0] + index * size, span[0] + (index + 1) * size)


def bindable(port: int, host: str = "0.0.0.0") -> bool:
    """True if ``port`` can be bound on ``host`` now (without SO_REUSEADDR: a port that
    still has a connection in TIME_WAIT counts as taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class _Ports:
    """This process's block of ports and where its walk through them has got to."""

    def __init__(self) -> None:
        self.block = _block()
        self.next = secrets.randbelow(len(self.block)) if self.block else 0

    def take(self, count: int, host: str) -> int:
        """The first of ``count`` consecutive ports, each bindable on 0.0.0.0 and ``host``."""
        if self.block is None:
            if count != 1:
                raise RuntimeError("no room below or above the ephemeral port range")
            return _kernel_port(host)
        block = self.block
        for _ in range(len(block)):
            start = self.next % len(block)
            if start + count > len(block):
                self.next = 0
                continue
            self.next = start + count
            first = block[start]
            ports = range(first, first + count)
            if all(bindable(p) and (host == "0.0.0.0" or bindable(p, host)) for p in ports):
                return first
        raise RuntimeError(f"no {count} free port(s) in {block}")


_ports: _Ports | None = None


def _mine() -> _Ports:
    global _ports
    if _ports is None:
        _ports = _Ports()
    return _ports


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def free_port(host: str = "0.0.0.0") -> int:
    """A TCP port free on ``host`` now (the default: on every address, as a user's is), from
    this worker's block."""
    return _mine().take(1, host)


def free_ports(count: int, host: str = "0.0.0.0") -> range:
    """``count`` consecutive TCP ports free now (a ``stage_ports`` range), from this
    worker's block."""
    first = _mine().take(count, host)
    return range(first, first + count)
