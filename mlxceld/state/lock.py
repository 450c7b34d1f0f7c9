"""One daemon per state dir: an exclusive flock on ``<state-dir>/mlxceld.lock``, in a
state dir that is ours and 0700 (``prepare_state_dir``).

The lock dies with the process (a SIGKILLed daemon leaves nothing to clean up),
and workers never inherit it (Python's descriptors are not inheritable). The file
holds the holder's pid on its first line and its control socket's path on the
second, so that a daemon refused the lock can say which process holds it and how
to stop it (``AlreadyRunning``'s ``pid`` and ``socket``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
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


def acquire(state_dir: Path, socket: Path | None = None) -> StateLock:
    """Take the state dir's lock and write our pid (and ``socket``) into its file; raise
    ``AlreadyRunning`` naming the holder's pid if another process has it."""
    path = state_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise DaemonError(f"cannot open lock file {path}: {exc.strerror}",
                          hint="check the state dir's owner and permissions") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, held_socket = _holder(os.pread(fd, _HOLDER_MAX, 0))
        os.close(fd)
        raise AlreadyRunning(
            f"another mlxceld (pid {pid if pid is not None else 'unknown'}) is already running "
            f"with state dir {state_dir}",
            hint=f"stop it first (mlxctl stop, or kill -TERM {pid or 'its pid'}), or pick "
            "another --state-dir", pid=pid, socket=held_socket,
        ) from None
    os.ftruncate(fd, 0)
    lines = [str(os.getpid()), *([] if socket is None else [str(socket)])]
    os.pwrite(fd, os.fsencode("".join(f"{line}\n" for line in lines)), 0)
    return StateLock(fd, path)


_HOLDER_MAX = 4096 + 32  # a pid line and a path


def _holder(content: bytes) -> tuple[int | None, Path | None]:
    """The pid and the socket written in a lock file (either may be missing or garbled)."""
    lines = content.decode(errors="replace").splitlines()
    first = lines[0].strip() if lines else ""
    pid = int(first) if first.isdigit() else None
    socket = Path(lines[1]) if len(lines) > 1 and lines[1].startswith("/") else None
    return pid, socket


def prepare_state_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_state_dir(path)
        os.chmod(path, 0o700)
    except OSError as exc:
        raise DaemonError(f"state dir {path} cannot be used: {exc.strerror}",
                          hint="check the path and its permissions, or pick another --state-dir"
                          ) from exc


def check_state_dir(path: Path) -> None:
    """An existing state dir is a directory of ours (`mlxceld --check-config` asks too,
    changing nothing); OSError where it cannot be looked at."""
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise DaemonError(f"state dir {path} is not a directory",
                          hint="pick another --state-dir (or [daemon] state_dir)")
    if st.st_uid != os.geteuid():
        raise DaemonError(f"state dir {path} belongs to uid {st.st_uid}, not to us "
                          f"(uid {os.geteuid()})",
                          hint="run mlxceld as its owner, or pick another --state-dir")
