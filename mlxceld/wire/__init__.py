"""MXCL v1 sans-IO core (PROTOCOL.md): secret and key ids, handshake, frames, envelope.

No asyncio, no sockets, no clock, no randomness of its own, and nothing else of
ours is imported here: the shell in mlxceld/net drives it.
"""

from mlxceld.wire.secret import (
    MIN_SECRET_BYTES,
    Keyring,
    SecretError,
    check_secret,
    key_id,
    trim_secret_file,
)

__all__ = ["MIN_SECRET_BYTES", "Keyring", "SecretError", "check_secret", "key_id",
           "trim_secret_file"]
