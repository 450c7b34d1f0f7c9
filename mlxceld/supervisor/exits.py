"""Why a worker exited: clean, a signal, a likely OOM kill, a Python exception, a status.

The classification reads what is there after the fact: the wait status, the
tail of the worker's log (for a traceback's last line), the exit record the
worker runtime leaves behind, and on Linux the cgroup's ``oom_kill`` counter.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from mlxceld.supervisor.states import ExitCause

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
    if sig == signal.SIGKILL:
        if oom_kills_grew:
            return ExitCause("oom", "killed by the kernel OOM killer (out of memory)", returncode)
        if oom_kills_grew is None:
            return ExitCause("oom", "killed by SIGKILL (likely out of memory)", returncode)
        return ExitCause("signal", "killed by SIGKILL", returncode)
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


def oom_kill_count() -> int | None:
    """This cgroup's OOM-kill count (cgroup v2, Linux), or None where it cannot be read."""
    try:
        cgroup = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        events = Path("/sys/fs/cgroup") / cgroup.lstrip("/") / "memory.events"
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None
