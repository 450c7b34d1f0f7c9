"""The ``keys`` table and the secret files beside it: this node's cluster keyring.

The table holds key ids (hex), their state and where each came from; each
secret itself lives in ``<state-dir>/keys/<keyid>.key`` (directory 0700, file
0600, written to a 0600 temp file and renamed into place). A secret is never
put in the database, a log line, an error message or an argv.

The file holds the secret's exact bytes (no newline): it is the secret after
PROTOCOL.md section 1 trimming, so reading it back is not trimmed again.
The first key installed becomes the primary; the primary cannot be removed.

A removed key id is remembered as *retired* (the ``settings`` row ``RETIRED_SETTING``:
key id -> when, the latest ``MAX_RETIRED``), so that a secret file still naming it
(a restart with the old ``--cluster-secret-file`` after a rotation) is known stale
(``cluster/keyring.py``); installing the secret again (`mlxctl secret install`)
un-retires it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import sqlite_utils

from mlxceld.errors import KeyringError, PrimaryKeyRemoval, StateError, UnknownKey
from mlxceld.privatefile import write_private
from mlxceld.state.settings import Settings
from mlxceld.types import JSON
from mlxceld.wire.secret import KEY_ID_BYTES, Keyring, SecretError, check_secret, key_id

log = logging.getLogger(__name__)

KeyState = Literal["primary", "installed"]
LIST_HINT = "see `mlxctl secret list` for the installed key ids"
RETIRED_SETTING = "retired_keys"
MAX_RETIRED = 32  # retired key ids remembered (the latest)


@dataclass(frozen=True)
class KeyInfo:
    key_id: str  # hex
    state: KeyState
    created_at: float
    source: str  # where it came from, e.g. "MLXCEL_CLUSTER_SECRET" or a file path

    def to_json(self) -> JSON:
        return {"key_id": self.key_id, "state": self.state, "created_at": self.created_at,
                "source": self.source}


def parse_key_id(text: str) -> bytes:
    """A key id as the user writes it (hex, 16 digits); KeyringError naming it otherwise."""
    try:
        kid = bytes.fromhex(text)
    except ValueError:
        kid = b""
    if len(kid) != KEY_ID_BYTES:
        raise KeyringError(f"{text!r} is not a key id (expected {2 * KEY_ID_BYTES} hex digits)",
                           hint=LIST_HINT)
    return kid


class KeyStore:
    """The keyring on disk (files + table), mirrored in memory as a ``Keyring``."""

    def __init__(self, db: sqlite_utils.Database, keys_dir: Path) -> None:
        self._db = db
        self._table = db.table("keys")
        self._settings = Settings(db)
        self.dir = keys_dir
        self.keyring = Keyring()
        self._prepare_dir()
        self._load()

    # -- queries ----------------------------------------------------------------------------

    def list(self) -> list[KeyInfo]:
        rows = self._table.rows_where(order_by="created_at, key_id")
        return [KeyInfo(r["key_id"], r["state"], r["created_at"], r["source"]) for r in rows]

    def info(self, kid: bytes) -> KeyInfo:
        for key in self.list():
            if key.key_id == kid.hex():
                return key
        raise UnknownKey(f"no installed cluster secret has key id {kid.hex()}", hint=LIST_HINT)

    def retired_at(self, kid: bytes) -> float | None:
        """When key id ``kid`` was removed from this keyring (None: it never was, or it
        was installed again since)."""
        when = self._retired().get(kid.hex())
        return when if isinstance(when, float | int) else None

    def _retired(self) -> dict[str, float]:
        found = self._settings.get(RETIRED_SETTING)
        return {k: v for k, v in found.items() if isinstance(v, float | int)} \
            if isinstance(found, dict) else {}

    def _mark_retired(self, kid: bytes, retired: bool) -> None:
        marks = self._retired()
        if retired:
            marks[kid.hex()] = time.time()
        elif marks.pop(kid.hex(), None) is None:
            return
        latest = sorted(marks.items(), key=lambda kv: kv[1])[-MAX_RETIRED:]
        self._settings.put(RETIRED_SETTING, dict(latest))

    def path(self, kid: bytes) -> Path:
        return self.dir / f"{kid.hex()}.key"

    # -- changes ----------------------------------------------------------------------------

    def install(self, secret: bytes, *, source: str, primary: bool = False) -> KeyInfo:
        """Install (idempotent) a secret; the first key, or ``primary=True``, becomes primary."""
        try:
            kid = key_id(check_secret(secret))
        except SecretError as exc:
            raise KeyringError(f"the cluster secret from {source} is unusable: {exc}",
                               hint="use at least 16 bytes; `mlxctl secret generate` makes one"
                               ) from exc
        self._write(kid, secret)
        self._mark_retired(kid, False)
        first = self.keyring.primary_id is None
        if kid not in self.keyring:
            self._table.insert({"key_id": kid.hex(), "state": "installed",
                                "created_at": time.time(), "source": source})
            self.keyring.add(secret)
            log.info("cluster secret %s installed (from %s)", kid.hex(), source)
        if primary or first:
            self.set_primary(kid)
        return self.info(kid)

    def set_primary(self, kid: bytes) -> KeyInfo:
        if kid not in self.keyring:
            raise UnknownKey(f"no installed cluster secret has key id {kid.hex()}",
                             hint=LIST_HINT)
        if self.keyring.primary_id != kid or self.info(kid).state != "primary":
            with self._db.conn:
                self._db.conn.execute("BEGIN")
                self._db.execute("UPDATE keys SET state = 'installed' WHERE state = 'primary'")
                self._db.execute("UPDATE keys SET state = 'primary' WHERE key_id = ?",
                                 [kid.hex()])
            secret = self.keyring.get(kid)
            assert secret is not None
            self.keyring.add(secret, primary=True)
            log.info("cluster secret %s is now the primary", kid.hex())
        return self.info(kid)

    def remove(self, kid: bytes) -> KeyInfo:
        info = self.info(kid)
        if info.state == "primary":
            others = [k.key_id for k in self.list() if k.key_id != kid.hex()]
            raise PrimaryKeyRemoval(
                f"cluster secret {kid.hex()} is the primary and cannot be removed",
                hint=(f"make another key primary first: mlxctl secret use {others[0]}" if others
                      else "install another secret with `mlxctl secret install FILE --primary` "
                      "first"),
            )
        # The file goes first: a row without its file is skipped at load, a stray secret is worse.
        try:
            self.path(kid).unlink(missing_ok=True)
        except OSError as exc:
            raise StateError(f"secret file {self.path(kid)} cannot be removed: {exc.strerror}",
                             hint=f"check the permissions of {self.dir}") from exc
        self._table.delete(kid.hex())
        self.keyring.remove(kid)
        self._mark_retired(kid, True)
        log.info("cluster secret %s removed", kid.hex())
        return info

    # -- files ------------------------------------------------------------------------------

    def _prepare_dir(self) -> None:
        try:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            os.chmod(self.dir, 0o700)
        except OSError as exc:
            raise StateError(f"keys directory {self.dir} cannot be used: {exc.strerror}",
                             hint="check the state dir's owner and permissions") from exc

    def _write(self, kid: bytes, secret: bytes) -> None:
        final = self.path(kid)
        try:
            write_private(final, secret)
        except OSError as exc:
            raise StateError(f"secret file {final} cannot be written: {exc.strerror}",
                             hint=f"check the permissions and free space of {self.dir}") from exc

    def _load(self) -> None:
        for info in self.list():
            kid = bytes.fromhex(info.key_id)
            path = self.path(kid)
            try:
                secret = path.read_bytes()
            except FileNotFoundError:
                if info.state == "primary":
                    raise StateError(
                        f"the primary cluster secret {info.key_id} has no file {path}",
                        hint="restore the file from a backup, or start with "
                        "--cluster-secret-file to install the cluster's secret again",
                    ) from None
                log.warning("cluster secret %s has no file %s; forgetting it", info.key_id, path)
                self._table.delete(info.key_id)
                continue
            except OSError as exc:
                raise StateError(f"secret file {path} cannot be read: {exc.strerror}",
                                 hint=f"check the permissions of {self.dir}") from exc
            if len(secret) < 16 or key_id(secret) != kid:
                raise StateError(f"secret file {path} does not hold the secret of key id "
                                 f"{info.key_id}",
                                 hint="restore it from a backup, or remove the key and install "
                                 "the cluster's secret again")
            self.keyring.add(secret, primary=info.state == "primary")
