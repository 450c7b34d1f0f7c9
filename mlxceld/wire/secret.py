"""The cluster secret and its key id (PROTOCOL.md section 1). Pure: no files, no logging.

The shell (mlxceld/net, the daemon) reads files and environment variables and
hands the bytes here; this module never sees a path and never prints a secret.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_SECRET_BYTES = 16
KEY_ID_BYTES = 8
_KEY_ID_LABEL = b"mlxcel v1 key id"


class SecretError(ValueError):
    """A secret is unusable; the message never contains the secret itself."""


def trim_secret_file(content: bytes) -> bytes:
    """A secret file's secret: the content less one trailing CRLF, or failing that one LF."""
    if content.endswith(b"\r\n"):
        return content[:-2]
    if content.endswith(b"\n"):
        return content[:-1]
    return content


def check_secret(secret: bytes) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"shorter than {MIN_SECRET_BYTES} bytes")
    return secret


def key_id(secret: bytes) -> bytes:
    """``HMAC(S, "mlxcel v1 key id")[0:8]``: tells a server which secret a client used."""
    return hmac.new(secret, _KEY_ID_LABEL, hashlib.sha256).digest()[:KEY_ID_BYTES]


@dataclass
class Keyring:
    """Secrets by key id; the primary is the one this node uses when it connects.

    A server accepts a client that uses any installed key id.
    """

    _secrets: dict[bytes, bytes] = field(default_factory=dict, repr=False)
    primary_id: bytes | None = None

    def add(self, secret: bytes, *, primary: bool = False) -> bytes:
        kid = key_id(check_secret(secret))
        self._secrets[kid] = secret
        if primary or self.primary_id is None:
            self.primary_id = kid
        return kid

    def remove(self, kid: bytes) -> None:
        if kid == self.primary_id:
            raise SecretError("the primary key cannot be removed; make another primary first")
        self._secrets.pop(kid, None)

    def replace_all(self, primary: bytes, others: Sequence[bytes] = ()) -> list[bytes]:
        """Become exactly ``primary`` and ``others``, in place (the listeners and dialers
        holding this object see the change at their next handshake); the ids dropped.

        Each step leaves a keyring that a reader on another thread may use: first the
        union, then the new primary, then only the new keys.
        """
        kid = key_id(check_secret(primary))
        wanted = {kid: primary, **{key_id(check_secret(s)): s for s in others}}
        dropped = [k for k in self._secrets if k not in wanted]
        self._secrets = {**self._secrets, **wanted}
        self.primary_id = kid
        self._secrets = wanted
        return dropped

    def others(self) -> list[bytes]:
        """The secrets other than the primary, by key id: what is accepted but not used."""
        return [self._secrets[k] for k in self.ids() if k != self.primary_id]

    def get(self, kid: bytes) -> bytes | None:
        return self._secrets.get(kid)

    def ids(self) -> list[bytes]:
        return sorted(self._secrets)

    @property
    def primary(self) -> bytes:
        if self.primary_id is None:
            raise SecretError("the keyring is empty")
        return self._secrets[self.primary_id]

    def __contains__(self, kid: object) -> bool:
        return kid in self._secrets

    def __len__(self) -> int:
        return len(self._secrets)
