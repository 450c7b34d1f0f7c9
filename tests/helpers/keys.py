"""Cluster secrets as the code under test takes them: a keyring, or a 0600 secret file."""

from __future__ import annotations

from pathlib import Path

from mlxceld.wire import Keyring


def keyring(*secrets: bytes) -> Keyring:
    """A keyring holding ``secrets``; the first is the primary."""
    ring = Keyring()
    for secret in secrets:
        ring.add(secret)
    return ring


def secret_file(root: Path, secret: bytes) -> Path:
    """``root/cluster.secret``: ``secret`` and a newline, mode 0600, as an operator writes it."""
    path = root / "cluster.secret"
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return path
