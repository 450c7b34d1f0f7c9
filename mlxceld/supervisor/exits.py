"""Why a worker exited: clean, a signal, an OOM kill, a Python exception, a status.

The classification reads what is there after the fact: the wait status, the
tail of the worker's log (for a traceback's last line), the exit record the
worker runtime leaves behind, and on Linux the ``oom_kill`` counter of the
daemon's memory cgroup, which counts every OOM kill in it and below it, workers
included (cgroup v2 ``memory.events``, v1 ``memory.oom_control``; found through
``/proc/self/cgroup`` and ``/proc/self/mountinfo``). A SIGKILL is called an OOM
kill only when that counter rose while the worker was known alive (the runner
reads it at the spawn and again at each answered health probe); where it cannot
be read (macOS, no memory controller) a SIGKILL is just "killed by SIGKILL":
the kernel did not say, so neither do we.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

from mlxceld.supervisor.events import ExitCause

TRACEBACK = "Traceback (most recent call last):"


def classify(returncode: int, log_tail: str, *, oom_kills_grew: bool | None) -> ExitCause:
    """``returncode`` as asyncio reports it (negative: killed by that signal).

    ``oom_kills_grew``: whether the cgroup's OOM-kill counter rose while the
    worker ran (None when the counter cannot be read, as on macOS).
    """
    if returncode == 0:
        return ExitCause("clean", "exited cleanly", 0)
    sig = -returncode if returncode < 0 else (returncode - 128 if returncode in _SHELL_KILLS
                                              else 0)
    if sig == signal.SIGKILL and oom_kills_grew:
        return ExitCause("oom", "killed by the kernel OOM killer (out of memory)", returncode)
    if sig:
        return ExitCause("signal", f"killed by {_signame(sig)}", returncode)
    last = last_exception(log_tail)
    if last:
        return ExitCause("exception", f"Python exception: {last}", returncode)
    return ExitCause("status", f"exited with status {returncode}", returncode)


_SHELL_KILLS = {128 + signal.SIGKILL}


def last_exception(log_tail: str) -> str:
    """The last line of the last traceback in the log tail ('ValueError: boom'), or ''."""
    at = log_tail.rfind(TRACEBACK)
    if at < 0:
        return ""
    for line in reversed(log_tail[at + len(TRACEBACK):].splitlines()):
        if line.strip() and not line.startswith((" ", "\t")):
            return line.strip()[:300]
    return ""


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def read_exit_record(path: Path, pid: int) -> ExitCause | None:
    """The cause a worker recorded itself, if the record is there and is this pid's."""
    try:
        record = json.loads(path.read_text())
        if record["pid"] != pid:
            return None
        return ExitCause(str(record["kind"]), str(record["summary"]), int(record["returncode"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def oom_kill_count(proc: Path = Path("/proc/self")) -> int | None:
    """The OOM-kill count of our memory cgroup and those below it (Linux), or None where
    no counter can be read. ``proc`` is ``/proc/self`` (a test's stand-in otherwise)."""
    try:
        cgroups = (proc / "cgroup").read_text()
        mounts = (proc / "mountinfo").read_text()
    except OSError:
        return None  # not Linux
    for path in _counter_files(cgroups, mounts):
        count = _oom_kill_line(path)
        if count is not None:
            return count
    return None


# The counter file of each cgroup version, by the file system type of its mount.
_COUNTERS = {"cgroup2": "memory.events", "cgroup": "memory.oom_control"}


def _counter_files(cgroups: str, mounts: str) -> list[Path]:
    """Where our cgroup's OOM-kill counter may be: cgroup v2 first, then v1's memory
    hierarchy, each under every mount of that hierarchy that shows our cgroup."""
    ours: dict[str, str] = {}  # "cgroup2" or "cgroup" -> our cgroup's path in it
    for line in cgroups.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            ours["cgroup2"] = path
        elif "memory" in controllers.split(","):
            ours["cgroup"] = path
    found = []
    for fstype in _COUNTERS:
        for root, mountpoint, options in _mounts(mounts, fstype):
            cgroup = ours.get(fstype)
            if cgroup is None or (fstype == "cgroup" and "memory" not in options):
                continue
            relative = os.path.relpath(cgroup, root)
            if relative == ".." or relative.startswith("../"):
                continue  # our cgroup is not inside what this mount shows
            found.append(Path(mountpoint) / relative / _COUNTERS[fstype])
    return found


def _mounts(mountinfo: str, fstype: str) -> list[tuple[str, str, list[str]]]:
    """(root, mount point, super options) of each mount of ``fstype`` (proc(5): the fields
    before " - " hold the root (4th) and the mount point (5th), octal-escaped)."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] == fstype:
            out.append((_unescape(fields[3]), _unescape(fields[4]), tail[2].split(",")))
    return out


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _oom_kill_line(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None
