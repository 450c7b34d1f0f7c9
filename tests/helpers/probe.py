"""``GET /health`` asked again and again from a process of its own, timed: how a server
answers while a test loads it (the test's own threads, opening thousands of sockets,
would otherwise hold the probe up on this process's GIL)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PROBE = """
import http.client, sys, time
host, port, every = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
while True:
    began = time.monotonic()
    try:
        c = http.client.HTTPConnection(host, port, timeout=5)
        c.request("GET", "/health")
        what = str(c.getresponse().status)
        c.close()
    except OSError as exc:
        what = type(exc).__name__
    print(f"{time.monotonic() - began:.4f} {what}", flush=True)
    time.sleep(every)
"""


@dataclass
class HealthProbe:
    """``GET /health`` on ``host:port``, a fresh connection every ``every`` s (5 s timeout
    each), while ``running``; then ``took`` (seconds) and ``failed`` (what was not 200)."""

    host: str
    port: int
    every: float = 0.2
    took: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def running(self) -> Iterator[HealthProbe]:
        proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, self.host, str(self.port), str(self.every)],
            stdout=subprocess.PIPE, text=True)
        try:
            yield self
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=10)
            for line in out.splitlines():
                took, _, what = line.partition(" ")
                if what:  # a line cut by the end is dropped
                    self.took.append(float(took))
                    if what != "200":
                        self.failed.append(what)

    def check(self, within: float, at_least: int) -> None:
        """Every probe answered 200 within ``within`` s, and there were ``at_least``."""
        assert not self.failed, self.failed
        assert len(self.took) >= at_least, self.took
        assert max(self.took) < within, f"/health took up to {max(self.took):.3f} s"


LISTEN, SYN_RECV = "0A", "03"  # the states of include/net/tcp_states.h, as /proc shows them


def waiting_to_be_accepted(port: int) -> int | None:
    """Connections to ``port`` the kernel holds that its server has not accepted yet: the
    listener's accept queue (its ``rx_queue`` in /proc/net/tcp) plus the handshakes still
    half done (``SYN_RECV``), which join that queue when their ACK is retried. None where
    /proc/net/tcp is not (not Linux). While the accept queue is full, a new client's SYN
    is dropped and retried only after the kernel's 1 s retransmission timeout."""
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        return None
    waiting = 0
    for table in tables:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) != port:
                    continue
                if fields[3] == LISTEN:
                    waiting += int(fields[4].split(":")[1], 16)
                elif fields[3] == SYN_RECV:
                    waiting += 1
    return waiting
