"""The MXCL v1 handshake (PROTOCOL.md section 2) as a state table, for both roles.

Bytes in (any split, down to one at a time), bytes out, and a ``HandshakeResult``
when done. Refusals raise ``RemoteProtocolError`` after queuing whatever answer
the protocol gives (a 2-byte reject, or nothing for noise and a bad client_auth):
the caller sends ``take_output()`` and closes.

Randomness is injected and drawn in a fixed order so the vectors reproduce:
the client draws its nonce then its ephemeral private key when it is built; the
server draws its nonce then its ephemeral private key once a hello has passed
every check.

Readings where the page is loose: a server treats any byte beyond the 32-byte
ClientAuth, received before it sent its verdict, as noise (a client cannot have
produced it legitimately); a client treats a ServerHello whose status is 0 but
whose version is not 1, a reject status it does not know, and a verdict other
than 0 or 1 (with a tag that verifies) as refusals.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Final, Protocol

from mlxceld.wire import hello as msg
from mlxceld.wire import schedule
from mlxceld.wire.crypto import NEGOTIABLE_SUITES, Suite, x25519, x25519_public
from mlxceld.wire.errors import LocalProtocolError, RemoteProtocolError
from mlxceld.wire.schedule import Channel

Random = Callable[[int], bytes]
PRE_AUTH_MAX: Final = msg.HELLO_FIXED_LEN + msg.MAX_IDENTITY + msg.AUTH_LEN


class SecretStore(Protocol):
    """What the handshake needs of a keyring (``mlxceld.wire.secret.Keyring`` is one)."""

    @property
    def primary(self) -> bytes: ...

    @property
    def primary_id(self) -> bytes | None: ...

    def get(self, kid: bytes) -> bytes | None: ...


class ConnectionRole(Enum):
    CLIENT = "client"  # opened the TCP connection
    SERVER = "server"


class HandshakeState(Enum):
    CLIENT_AWAIT_STATUS = auto()
    CLIENT_AWAIT_SERVER_HELLO = auto()
    CLIENT_AWAIT_VERDICT = auto()
    SERVER_AWAIT_HELLO = auto()
    SERVER_AWAIT_IDENTITY = auto()
    SERVER_AWAIT_CLIENT_AUTH = auto()
    DONE = auto()
    FAILED = auto()


S = HandshakeState
# The whole machine: state -> (bytes it waits for, step, state after the step succeeds).
# ``None`` bytes: the identity length announced by the hello. A step that refuses raises,
# and the machine goes to FAILED; DONE and FAILED take no input.
TABLE: Final[dict[HandshakeState, tuple[int | None, str, HandshakeState]]] = {
    S.CLIENT_AWAIT_STATUS: (2, "_client_status", S.CLIENT_AWAIT_SERVER_HELLO),
    S.CLIENT_AWAIT_SERVER_HELLO: (msg.SERVER_HELLO_LEN - 2, "_client_server_hello",
                                  S.CLIENT_AWAIT_VERDICT),
    S.CLIENT_AWAIT_VERDICT: (msg.VERDICT_LEN, "_client_verdict", S.DONE),
    S.SERVER_AWAIT_HELLO: (msg.HELLO_FIXED_LEN, "_server_hello_head", S.SERVER_AWAIT_IDENTITY),
    S.SERVER_AWAIT_IDENTITY: (None, "_server_identity", S.SERVER_AWAIT_CLIENT_AUTH),
    S.SERVER_AWAIT_CLIENT_AUTH: (msg.AUTH_LEN, "_server_client_auth", S.DONE),
}


@dataclass(frozen=True, slots=True)
class HandshakeResult:
    channel: Channel
    suite: Suite
    key_id: bytes
    verdict: int  # 0 accepted, 1 at capacity (server side; a client raises on 1)
    peer_identity: str | None  # the client's identity, on the server side
    send_secret: bytes  # this side's sending traffic secret
    recv_secret: bytes


class Handshake:
    """One side of one handshake. Build with ``client()`` or ``server()``."""

    def __init__(self, role: ConnectionRole, suite: Suite, keyring: SecretStore,
                 random: Random) -> None:
        self.role = role
        self.suite = suite
        self._keyring = keyring
        self._random = random
        self._buf = bytearray()
        self._received = 0
        self._out = bytearray()
        self.result: HandshakeResult | None = None
        # Transcript and secrets; the ephemeral ones are dropped when the handshake ends.
        self._channel = Channel.TRANSPORT
        self._identity: str | None = None
        self._source_ip = ""
        self._capacity_ok: Callable[[], bool] = lambda: True
        self._secret = b""
        self._key_id = b""
        self._private = b""
        self._head: msg.HelloHead | None = None
        self._client_hello = b""
        self._server_hello = b""
        self._client_auth = b""
        self._prk = b""
        self._ks = b""
        self._kc = b""
        self.state = S.FAILED

    @classmethod
    def client(cls, *, suite: Suite, channel: Channel, identity: str, keyring: SecretStore,
               random: Random) -> Handshake:
        if suite not in NEGOTIABLE_SUITES:
            raise LocalProtocolError(f"suite {suite!r} cannot be negotiated")
        hs = cls(ConnectionRole.CLIENT, suite, keyring, random)
        hs._channel = Channel(channel)
        hs._secret, kid = keyring.primary, keyring.primary_id
        if kid is None:
            raise LocalProtocolError("the keyring has no primary secret")
        hs._key_id = kid
        nonce = random(msg.NONCE_LEN)
        hs._private = random(32)
        hs._client_hello = msg.ClientHello(msg.VERSION, suite, channel, kid, nonce,
                                           x25519_public(hs._private), identity).encode()
        hs._out += hs._client_hello
        hs.state = S.CLIENT_AWAIT_STATUS
        return hs

    @classmethod
    def server(cls, *, suite: Suite, keyring: SecretStore, random: Random, source_ip: str,
               capacity_ok: Callable[[], bool] = lambda: True) -> Handshake:
        if suite not in NEGOTIABLE_SUITES:
            raise LocalProtocolError(f"suite {suite!r} cannot be negotiated")
        hs = cls(ConnectionRole.SERVER, suite, keyring, random)
        hs._source_ip = source_ip
        hs._capacity_ok = capacity_ok
        hs.state = S.SERVER_AWAIT_HELLO
        return hs

    @property
    def awaiting_hello(self) -> bool:
        """A server that has not yet received the whole ClientHello."""
        return self.state in (S.SERVER_AWAIT_HELLO, S.SERVER_AWAIT_IDENTITY)

    # -- driving -------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """Consume ``data``; answer the bytes that follow the handshake (frames), if done."""
        if self.state in (S.DONE, S.FAILED):
            raise LocalProtocolError(f"the handshake is over ({self.state.name})")
        self._buf += data
        self._received += len(data)
        try:
            while self.state in TABLE:
                if self.role is ConnectionRole.SERVER and self._received > self._pre_auth_limit():
                    raise msg.noise("more bytes than a hello and its ClientAuth")
                wanted, step, after = TABLE[self.state]
                if wanted is None:
                    assert self._head is not None
                    wanted = self._head.identity_len
                if len(self._buf) < wanted:
                    return b""
                chunk = bytes(self._buf[:wanted])
                del self._buf[:wanted]
                getattr(self, step)(chunk)
                self.state = after
        except RemoteProtocolError:
            self.state = S.FAILED
            self._drop_secrets()
            raise
        rest = bytes(self._buf)
        self._buf.clear()
        return rest

    def _pre_auth_limit(self) -> int:
        """A server reads at most the hello and the ClientAuth before it authenticates."""
        if self._head is None:
            return PRE_AUTH_MAX
        return msg.HELLO_FIXED_LEN + self._head.identity_len + msg.AUTH_LEN

    def take_output(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def _drop_secrets(self) -> None:
        """Forget ephemeral keys, dh, PRK, Ks and Kc (forward secrecy)."""
        self._private = self._prk = self._ks = self._kc = b""
        self._secret = b""

    def _derive(self, peer_share: bytes, client_nonce: bytes, server_nonce: bytes) -> None:
        dh = x25519(self._private, peer_share)
        self._private = b""
        if dh is None:
            raise RemoteProtocolError("the peer's X25519 share gives an all-zero secret",
                                      kind="invalid_share")
        self._prk = schedule.prk(client_nonce, server_nonce, self._secret, dh)
        self._ks, self._kc = schedule.auth_keys(self._prk)

    def _finish(self, verdict_message: bytes) -> None:
        th = schedule.transcript_hash(self._client_hello, self._server_hello,
                                      self._client_auth, verdict_message)
        c2s, s2c = schedule.traffic_secrets(self._prk, self._channel, th)
        client = self.role is ConnectionRole.CLIENT
        self.result = HandshakeResult(
            channel=self._channel, suite=self.suite, key_id=self._key_id,
            verdict=verdict_message[0], peer_identity=self._identity,
            send_secret=c2s if client else s2c, recv_secret=s2c if client else c2s)
        self._drop_secrets()

    # -- client steps --------------------------------------------------------------------

    def _client_status(self, data: bytes) -> None:
        status, version = data[0], data[1]
        if status == msg.STATUS_OK and version == msg.VERSION:
            self._server_hello = data
            return
        if status == msg.STATUS_OK:
            raise RemoteProtocolError(f"server speaks version {version}, not {msg.VERSION}",
                                      kind="version_mismatch")
        kind, reason = msg.REJECTS.get(status, ("rejected", f"reject status {status}"))
        raise RemoteProtocolError(f"server refused the hello: {reason} "
                                  f"(server version {version})", kind=kind)

    def _client_server_hello(self, data: bytes) -> None:
        server_nonce, share, auth = data[:32], data[32:64], data[64:]
        head = self._server_hello + server_nonce + share
        self._server_hello = head + auth
        self._derive(share, self._client_hello[16:48], server_nonce)
        expected = schedule.server_auth(self._ks, self._client_hello, head)
        if not hmac.compare_digest(expected, auth):
            raise RemoteProtocolError(
                "server_auth does not verify: the server holds a different cluster secret "
                "(compare key ids with mlxctl)", kind="wrong_secret_client")
        self._client_auth = schedule.client_auth(self._kc, self._client_hello,
                                                 self._server_hello)
        self._out += self._client_auth

    def _client_verdict(self, data: bytes) -> None:
        verdict, tag = data[0], data[1:]
        expected = schedule.verdict_tag(self._ks, self._client_hello, self._server_hello,
                                        self._client_auth, verdict)
        if not hmac.compare_digest(expected, tag):
            raise RemoteProtocolError("verdict does not verify under the cluster secret",
                                      kind="wrong_secret_client")
        if verdict == msg.VERDICT_AT_CAPACITY:
            raise RemoteProtocolError("server at capacity; retry with backoff",
                                      kind="at_capacity")
        if verdict != msg.VERDICT_ACCEPTED:
            raise RemoteProtocolError(f"unknown verdict {verdict}", kind="rejected")
        self._finish(data)

    # -- server steps --------------------------------------------------------------------

    def _server_hello_head(self, data: bytes) -> None:
        self._head = msg.parse_hello_head(data)
        self._client_hello = data

    def _refuse(self, status: int) -> None:
        kind, reason = msg.REJECTS[status]
        self._out += msg.reject(status)
        raise RemoteProtocolError(f"refused the client's hello: {reason}", kind=kind)

    def _server_identity(self, data: bytes) -> None:
        head = self._head
        assert head is not None
        host, _port = msg.parse_identity(data)
        self._client_hello += data
        if head.version != msg.VERSION:
            self._refuse(1)
        if head.suite != self.suite:
            self._refuse(2)
        secret = self._keyring.get(head.key_id)
        if secret is None:
            self._refuse(3)
        if not msg.identity_owned(host, self._source_ip):
            self._refuse(4)
        assert secret is not None
        self._secret, self._key_id = secret, head.key_id
        self._channel, self._identity = Channel(head.channel), data.decode("utf-8")
        server_nonce = self._random(msg.NONCE_LEN)
        self._private = self._random(32)
        share = x25519_public(self._private)
        self._derive(head.share, head.nonce, server_nonce)
        hello_head = bytes([msg.STATUS_OK, msg.VERSION]) + server_nonce + share
        auth = schedule.server_auth(self._ks, self._client_hello, hello_head)
        self._server_hello = hello_head + auth
        self._out += self._server_hello

    def _server_client_auth(self, data: bytes) -> None:
        expected = schedule.client_auth(self._kc, self._client_hello, self._server_hello)
        if not hmac.compare_digest(expected, data):
            raise RemoteProtocolError(
                "client_auth does not verify: the client most likely holds a different "
                "cluster secret", kind="wrong_secret_server")
        self._client_auth = data
        verdict = msg.VERDICT_ACCEPTED if self._capacity_ok() else msg.VERDICT_AT_CAPACITY
        message = bytes([verdict]) + schedule.verdict_tag(
            self._ks, self._client_hello, self._server_hello, data, verdict)
        self._out += message
        self._finish(message)
