"""Per-worker log files: opened by the daemon, written by the worker, rotated by size.

The worker's stdout and stderr are the log file itself (opened O_APPEND), not a
pipe through the daemon, so a worker keeps logging while the daemon restarts.
Rotation is copy-then-truncate: the worker's descriptor stays valid and its
next write lands at the new end. Lines written between the copy and the
truncate can be lost; that window is a few milliseconds per rotation.

The daemon's own ``--log-file`` (``[daemon] log_file``) is rotated the same way, by
``RotatingLog``: launchd's ``StandardErrorPath`` and Homebrew's ``log_path`` name the same
file and hold a descriptor on it, which a rename would leave writing to the old copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from io import TextIOWrapper
from pathlib import Path

from mlxceld.logformat import JsonFormatter, LogFormat
from mlxceld.privatefile import private_opener

READ_CHUNK = 64 * 1024


def open_for_worker(path: Path, banner: str, log_format: LogFormat = "text") -> int:
    """An O_APPEND descriptor for a worker's stdout/stderr, after writing a banner line
    (in json, one object as the worker's own lines: ``logformat.py``)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    if log_format == "json":
        record = logging.LogRecord(__name__, logging.INFO, __file__, 0, banner, None, None)
        line = JsonFormatter().format(record)
    else:
        line = f"=== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} mlxceld: {banner} ==="
    os.write(fd, f"{line}\n".encode())
    return fd


def rotate_if_needed(path: Path, max_bytes: int, backups: int) -> bool:
    """Copy ``path`` to ``path.1`` (shifting older copies) and truncate it, when over the size."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    for i in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{i + 1}"))
    if backups > 0:
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        os.chmod(path.with_name(f"{path.name}.1"), 0o600)
    with path.open("r+b") as f:
        f.truncate(0)
    return True


class RotatingLog(logging.FileHandler):
    """The daemon's log file (O_APPEND), rotated by copy-then-truncate once a record leaves it
    over ``max_bytes`` (0: never), keeping ``backups`` old copies (``FILE.1`` newest). Closed
    on SIGHUP and reopened by the next record, as a ``FileHandler`` is. A file it creates is
    0600, as every copy is."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        super().__init__(path, mode="a")
        self._max_bytes, self._backups = max_bytes, backups

    def _open(self) -> TextIOWrapper:
        """``FileHandler``'s open (at start, and after a SIGHUP closed it), 0600 if new."""
        return open(self.baseFilename, "a", encoding=self.encoding, errors=self.errors,
                    opener=private_opener)

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if self._max_bytes <= 0 or self.stream is None:
            return
        try:
            if os.fstat(self.stream.fileno()).st_size > self._max_bytes:
                rotate_if_needed(Path(self.baseFilename), self._max_bytes, self._backups)
        except (OSError, ValueError):
            self.handleError(record)


def tail(path: Path, lines: int) -> tuple[str, int]:
    """The last ``lines`` lines of the file and the offset where the file ends."""
    try:
        with path.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            start, data = end, b""
            while start > 0 and data.count(b"\n") <= lines:
                start = max(0, start - READ_CHUNK)
                f.seek(start)
                data = f.read(end - start)
    except FileNotFoundError:
        return "", 0
    text = data.decode("utf-8", "replace")
    kept = text.splitlines(keepends=True)[-lines:] if lines > 0 else []
    return "".join(kept), end


def read_from(path: Path, offset: int) -> tuple[bytes, int]:
    """What was appended since ``offset``; starts over at 0 when the file was truncated."""
    with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        if end < offset:
            offset = 0
        f.seek(offset)
        data = f.read(min(end - offset, 1 << 20))
        return data, offset + len(data)
    return b"", 0


ROTATE_EVERY_S = 5.0  # between two looks at the workers' log sizes
log = logging.getLogger(__name__)


async def rotate_forever(logs: Callable[[], list[tuple[str, Path]]], max_bytes: int,
                         backups: int) -> None:
    """Every ``ROTATE_EVERY_S``, each of ``logs()`` (a worker's name, its log file) rotated
    once past ``max_bytes`` (``rotate_if_needed``); a failure is logged, never raised."""
    while True:
        await asyncio.sleep(ROTATE_EVERY_S)
        for name, path in logs():
            try:
                if rotate_if_needed(path, max_bytes, backups):
                    log.info("worker %s: log rotated", name)
            except OSError as exc:
                log.warning("worker %s: log rotation failed: %s", name, exc)
