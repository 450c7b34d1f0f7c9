"""CPU for the processes a benchmark starts, held steady: a fresh cgroup for each, weighted
above the rest of the machine and, where asked, held to a fraction of one CPU
(bench/plan_speed_measured.py's hosts: the slow one held to a quota, the others not).

``CpuGroup.make(name, fraction)`` creates the cgroup under the cpu controller's
hierarchy, cgroup v1 (``cpu.shares``, ``cpu.cfs_period_us`` and ``cpu.cfs_quota_us``,
where a v1 cpu controller is mounted: it then holds the cpu controller, even on a
machine that mounts v2 too) or v2 (``cpu.weight``, ``cpu.max``; the cpu controller
enabled in the root's ``cgroup.subtree_control``); it raises ``QuotaUnavailable``,
naming the file and the reason, where neither is mounted or writable (not root, a
read-only ``/sys/fs/cgroup``). ``probe()`` says so without keeping anything.

The weight is ``WEIGHT`` times the default (a process of the root cgroup, or a group
left as made, weighs 1): a quota is only a ceiling, and on a loaded machine the other
processes on a host's CPU would take its share, the fast host's most of all (seen at a
load average of 5 on 2 CPUs, the hosts pinned to one CPU each, the slow one at a 0.25
quota: both measured 0.31 units). Weighted, a group gets its CPU (up to its quota)
before the rest, whose processes get what it leaves; a decode's bursts leave most.

``wrap(argv)`` is the command line that joins the cgroup, then execs ``argv``: the process
is in it before it runs a line of its own, and its children (a daemon's workers, its
compute-units measurement) inherit it. ``remove()`` removes the cgroup once its processes
are ended (the caller ends them by pid; whatever is still listed there afterwards is
killed by pid and waited for).

The period is ``PERIOD_US``, 10 ms, not the kernel's default 100 ms: a daemon measures
its compute units over 0.2 s (``models/speed.py``), two 100 ms periods, whose rate then
depends on where in a period the measurement starts (seen at a quota of 0.25: 0.33 to
0.41 units against 0.36 to 0.39 with 10 ms periods, 1.5 unthrottled, on a 2-CPU machine);
a decode token waits at most 7.5 ms for the next period, not 75.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

PERIOD_US: Final = 10_000
WEIGHT: Final = 100  # times the default: v1 cpu.shares 1024 -> 102400, v2 cpu.weight 100 -> 10000
MIN_QUOTA_US: Final = 1_000  # the kernel refuses a smaller quota
WAIT_S: Final = 5.0  # for the listed processes to leave, once ended


class QuotaUnavailable(Exception):
    """No cgroup with a CPU quota can be made here; the message says why."""


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, type, options) of each cgroup mount in ``/proc/self/mounts``."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
            found.append((fields[1], fields[2], fields[3].split(",")))
    return found


def hierarchy() -> tuple[int, Path]:
    """The cgroup version holding the cpu controller and the directory to make groups in."""
    mounts = _mounts()
    for point, kind, options in mounts:
        if kind == "cgroup" and "cpu" in options:
            return 1, Path(point)
    for point, kind, _ in mounts:
        controllers = Path(point) / "cgroup.controllers"
        if kind == "cgroup2" and controllers.exists():
            if "cpu" not in controllers.read_text().split():
                raise QuotaUnavailable(f"{controllers} lists no cpu controller")
            return 2, Path(point)
    raise QuotaUnavailable("no cgroup hierarchy with the cpu controller is mounted "
                           "(/proc/self/mounts)")


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise QuotaUnavailable(f"cannot write {text.strip()!r} to {path}: "
                               f"{exc.strerror or exc}") from None


@dataclass(frozen=True)
class CpuGroup:
    """A cgroup made by ``make``, weighted ``WEIGHT``, held to ``fraction`` of one CPU
    (None: not held)."""

    path: Path
    version: int
    fraction: float | None

    @classmethod
    def make(cls, name: str, fraction: float | None,
             period_us: int = PERIOD_US) -> CpuGroup:
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"a CPU quota is a fraction in (0, 1], not {fraction}")
        quota_us = None if fraction is None else max(MIN_QUOTA_US, round(fraction * period_us))
        version, parent = hierarchy()
        if version == 2:
            control = parent / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                _write(control, "+cpu")
        path = parent / name
        try:
            path.mkdir()
        except OSError as exc:
            raise QuotaUnavailable(f"cannot make the cgroup {path}: "
                                   f"{exc.strerror or exc}") from None
        group = cls(path, version, None if quota_us is None else quota_us / period_us)
        try:
            if version == 1:
                _write(path / "cpu.shares", str(1024 * WEIGHT))
                if quota_us is not None:
                    _write(path / "cpu.cfs_period_us", str(period_us))
                    _write(path / "cpu.cfs_quota_us", str(quota_us))
            else:
                _write(path / "cpu.weight", str(100 * WEIGHT))
                if quota_us is not None:
                    _write(path / "cpu.max", f"{quota_us} {period_us}")
        except QuotaUnavailable:
            group.remove()
            raise
        return group

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run in this cgroup: a shell writes its own pid into ``cgroup.procs``,
        then execs ``argv`` (the same pid)."""
        return ["sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh",
                str(self.path / "cgroup.procs"), *argv]

    def pids(self) -> list[int]:
        with contextlib.suppress(FileNotFoundError):
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        return []

    def throttled(self) -> int:
        """How many periods its processes were held back (``cpu.stat``'s nr_throttled)."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "nr_throttled":
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroup; a process still in it, ``WAIT_S`` after the call, is killed by
        pid first (the caller ends its own before)."""
        deadline = time.monotonic() + WAIT_S
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY while a killed process is still listed
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def probe() -> str | None:
    """None where a quota group can be made here (one is made and removed); else why not."""
    try:
        CpuGroup.make(f"mxprobe-{os.getpid()}", 0.5).remove()
    except QuotaUnavailable as exc:
        return str(exc)
    return None
