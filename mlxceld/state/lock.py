"""One daemon per state dir: an exclusive flock on ``<state-dir>/mlxceld.lock``, in a
state dir that is ours and 0700 (``prepare_state_dir``).

The lock dies with the process (a SIGKILLed daemon leaves nothing to clean up),
and workers never inherit it (Python's descriptors are not inheritable).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from mlxceld.errors import AlreadyRunning, DaemonError

LOCK_NAME = "mlxceld.lock"


class StateLock:
    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def acquire(state_dir: Path) -> StateLock:
    path = state_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise DaemonError(f"cannot open lock file {path}: {exc.strerror}",
                          hint="check the state dir's owner and permissions") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AlreadyRunning(
            f"another mlxceld (pid {holder}) is already running with state dir {state_dir}",
            hint=f"stop it first (mlxctl stop, or kill {holder}), or pick another --state-dir",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateLock(fd, path)


def prepare_state_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
        if st.st_uid != os.geteuid():
            raise DaemonError(f"state dir {path} belongs to uid {st.st_uid}, not to us "
                              f"(uid {os.geteuid()})",
                              hint="run mlxceld as its owner, or pick another --state-dir")
        os.chmod(path, 0o700)
    except OSError as exc:
        raise DaemonError(f"state dir {path} cannot be used: {exc.strerror}",
                          hint="check the path and its permissions, or pick another --state-dir"
                          ) from exc
