"""The wire's exceptions; nothing else of ours is imported here.

    WireError                      root of everything the wire core raises
    ├── LocalProtocolError         our own misuse: sending before the handshake, after close
    └── RemoteProtocolError        the peer's doing: close the connection, log ``kind``
        ├── EnvelopeError          a message payload that breaks section 4 or its allow-list
        └── BeaconError            a discovery record to ignore (section 5)

``RemoteProtocolError.reason`` is safe to send back in a close frame and to log;
``kind`` is a short tag for the security log (see ``KINDS``). Neither ever
contains key material or payload bytes.
"""

from __future__ import annotations

from typing import Final

KINDS: Final = frozenset({
    "noise",                # bad magic or a malformed hello: closed without an answer
    "version_mismatch",     # reject status 1
    "suite_mismatch",       # reject status 2
    "unknown_key_id",       # reject status 3
    "identity_not_owned",   # reject status 4
    "rejected",             # a reject status this implementation does not know
    "wrong_secret_client",  # seen by a client: server_auth or the verdict did not verify
    "wrong_secret_server",  # seen by a server: client_auth did not verify
    "invalid_share",        # an X25519 share whose shared secret is all zero
    "at_capacity",          # verdict 1
    "handshake_timeout",    # the handshake took longer than its bound (5 s)
    "hello_timeout",        # a server's shorter bound on the ClientHello alone ran out
    "frame_auth_failed",    # a frame that does not open
    "malformed_frame",      # length below the tag size, bad close reason, non-empty key update
    "unknown_frame_kind",   # an authenticated frame of an unknown kind
    "oversized_frame",      # a length above the receiver's maximum, seen in the header
    "key_limit_exceeded",   # the peer sent too much under one traffic secret
    "frame_after_close",    # bytes after the peer's close frame
    "abort",                # end of stream without a close frame
    "bad_envelope",         # section 4 violations
    "bad_beacon",           # section 5 violations
})


class WireError(Exception):
    """Root of every exception the wire core raises."""


class LocalProtocolError(WireError):
    """We used the connection wrongly (our bug), e.g. sent a message before the handshake."""


class RemoteProtocolError(WireError):
    """The peer broke the protocol or refused us; close the connection.

    ``reason`` goes into the close frame (where one can still be sent) and the log;
    ``kind`` is one of ``KINDS``, for the security log.
    """

    def __init__(self, reason: str, *, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown wire error kind {kind!r}")
        super().__init__(reason)
        self.reason = reason
        self.kind = kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason!r}, kind={self.kind!r})"


class EnvelopeError(RemoteProtocolError):
    """A message payload that breaks the envelope rules or the allow-list for its type."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, kind="bad_envelope")


class BeaconError(RemoteProtocolError):
    """A discovery record to ignore: bad MAC, other version or cluster, stale."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, kind="bad_beacon")
