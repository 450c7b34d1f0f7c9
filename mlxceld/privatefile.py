"""Files only their owner may read (secrets, logs): 0600 from the first byte; a secret's
replaced atomically."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_private(path: Path, content: bytes) -> None:
    """Write ``content`` to a 0600 temp file beside ``path``, fsync it, rename it over
    ``path`` and fsync the directory: readers see the old file or the new, never half.
    Raises OSError (the caller names the file in its own error)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # in case the temp name existed with other bits
            os.write(fd, content)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for ``open()``: a file it creates is 0600 from the first byte, whatever
    the umask (the daemon's ``--log-file`` is opened before the daemon sets its own); an
    existing file keeps the mode its owner gave it."""
    return os.open(path, flags, 0o600)
