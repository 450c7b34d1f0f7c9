"""The network shell's exceptions, under the one root ``MlxceldError``.

    MlxceldError
    └── NetError                  something on an MXCL v1 connection failed
        ├── ConnectionClosed      the stream ended: a close frame, an abort or a protocol error
        ├── HandshakeFailed       the handshake was refused or failed; ``kind`` says why
        ├── AskFailed             one question to an agent (``net.agent.ask``) got no answer
        │                         to use; ``kind`` says at which step
        └── LinkTestFailed        a link test with a peer's agent (``net.link.measure``) did
                                  not finish; ``kind`` says at which step

``kind`` is the wire core's tag (``mlxceld.wire.errors.KINDS``), or ``"closed"`` for a
clean close frame from the peer and ``"local"`` for a stream we closed ourselves.
"""

from __future__ import annotations

from mlxceld.errors import MlxceldError


class NetError(MlxceldError):
    code = "net"


class ConnectionClosed(NetError):
    """The stream is over; ``reason`` is the peer's close reason or the error's."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(f"connection closed ({kind}): {reason}" if reason
                         else f"connection closed ({kind})")
        self.reason = reason
        self.kind = kind


class HandshakeFailed(NetError):
    """The handshake with ``peer`` did not produce a connection."""

    def __init__(self, kind: str, message: str, *, peer: str = "") -> None:
        super().__init__(message, hint=_HINTS.get(kind, ""))
        self.kind = kind
        self.peer = peer


class AskFailed(NetError):
    """Asking the agent at ``peer`` one question (``mlxceld.net.agent.ask``) brought no
    answer to use. ``kind`` is the step (``ASK_KINDS``); ``detail`` the handshake's kind
    (``connect``), the close's kind (``closed``) or the agent's reason (``error``); the
    message says what went wrong, in the underlying error's words."""

    code = "ask_failed"

    def __init__(self, kind: str, message: str, *, peer: str, detail: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.peer = peer
        self.detail = detail


ASK_KINDS = {
    "address": "the agent's address is not host:port (nothing was dialled)",
    "connect": "no authenticated stream within the connect deadline",
    "timeout": "no answer within the answer deadline",
    "closed": "the stream ended before the answer",
    "bad_answer": "the answer breaks the envelope or is of a type not expected",
    "error": "the agent answered ``error`` (a type it does not serve, or a refusal)",
}


class LinkTestFailed(NetError):
    """The link test with the agent at ``peer`` (``mlxceld.net.link.measure``) did not
    finish. ``kind`` is the step (``LINK_KINDS``); the message names the peer and why."""

    code = "link_test_failed"

    def __init__(self, kind: str, message: str, *, peer: str, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.kind = kind
        self.peer = peer


LINK_KINDS = {
    "address": "the peer is not host:port (nothing was dialled)",
    "connect": "no authenticated stream within the connect deadline",
    "stalled": "an answer (a pong, an ack, a chunk) did not come within the stall bound",
    "timeout": "the whole measurement did not end within its deadline",
    "closed": "the stream ended before the test did",
    "refused": "the peer answered ``error`` (a size above its bound, or no link test)",
    "bad_answer": "an answer breaks the envelope, or is not the one expected",
}


_HINTS = {
    "wrong_secret_client": "the peer holds a different cluster secret; check both secret files",
    "wrong_secret_server": "the client most likely holds a different cluster secret",
    "unknown_key_id": "the peer does not hold our primary secret; install it on the peer",
    "identity_not_owned": "advertise an identity whose IP is the address we connect from",
    "version_mismatch": "upgrade both nodes to the same protocol version",
    "suite_mismatch": "use the same cipher suite on both nodes",
    "at_capacity": "the peer holds its maximum of connections; try again later",
}
