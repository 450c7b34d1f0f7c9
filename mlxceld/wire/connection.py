"""One MXCL v1 connection, sans IO (h11 style): bytes and time in, events and bytes out.

    conn = Connection(ConnectionRole.CLIENT, keyring=kr, random=os.urandom, now=t,
                      channel=Channel.TRANSPORT, identity="10.0.0.2:19100")
    conn.receive_data(data, now)    # b"" is end of stream; raises RemoteProtocolError
    conn.next_event()               # HandshakeComplete | MessageReceived | ... | None
    conn.send_message(payload); conn.close(reason); conn.data_to_send()
    conn.buffers_to_send()          # the same, unjoined: a shell writes each (no copy)
    conn.next_deadline(); conn.handle_timer(now)

The handshake has ``handshake_timeout`` (5 s) from ``now`` at construction. A server
may also be given ``hello_timeout``, a shorter bound on the ClientHello alone (a
socket that stays silent, or dribbles its hello, is failed as ``hello_timeout``);
``awaiting_hello`` says whether the hello is still outstanding.

The core never reads a clock: ``now`` is whatever monotonic time the shell uses.
Every ``RemoteProtocolError`` leaves the connection broken; what ``data_to_send()``
still holds is the protocol's answer (a reject, or a close frame carrying the
error's reason once the handshake is done) and the shell sends it, then closes
the socket. A ``LocalProtocolError`` is our own misuse and changes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mlxceld.wire.crypto import Buffer, Suite
from mlxceld.wire.errors import LocalProtocolError, RemoteProtocolError
from mlxceld.wire.events import (
    Event,
    HandshakeComplete,
    HandshakeRefused,
    KeyUpdated,
    MessageReceived,
    PeerClosed,
)
from mlxceld.wire.frames import (
    DEFAULT_LIMITS,
    MAX_CLOSE_REASON,
    FrameLimits,
    FrameReceiver,
    FrameSender,
    Kind,
)
from mlxceld.wire.handshake import ConnectionRole, Handshake, Random, SecretStore
from mlxceld.wire.hello import VERDICT_ACCEPTED
from mlxceld.wire.schedule import Channel

HANDSHAKE_TIMEOUT_S = 5.0


class Connection:
    def __init__(self, role: ConnectionRole, *, keyring: SecretStore, random: Random, now: float,
                 channel: Channel | None = None, identity: str | None = None,
                 suite: Suite = Suite.AES_256_GCM, peer_ip: str | None = None,
                 capacity_ok: Callable[[], bool] = lambda: True,
                 limits: FrameLimits = DEFAULT_LIMITS,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                 hello_timeout: float | None = None) -> None:
        """A client needs ``channel`` and ``identity`` (its advertised listener ``host:port``);
        a server needs ``peer_ip`` (the TCP source) and accepts any channel, reported in
        ``HandshakeComplete``. ``capacity_ok`` is asked once a client is authenticated:
        ``False`` answers verdict 1. ``hello_timeout`` (server only): the ClientHello must
        be complete that long after ``now``."""
        self.role = role
        self._limits = limits
        self._deadline: float | None = now + handshake_timeout
        self._hello_deadline: float | None = None
        if hello_timeout is not None and role is ConnectionRole.SERVER:
            self._hello_deadline = now + hello_timeout
        self._events: deque[Event] = deque()
        self._out: list[bytes | bytearray] = []
        self._sender: FrameSender | None = None
        self._receiver: FrameReceiver | None = None
        self._broken = False
        self._our_closed = False
        self._their_closed = False
        if role is ConnectionRole.CLIENT:
            if channel is None or identity is None:
                raise LocalProtocolError("a client connection needs a channel and an identity")
            self._hs: Handshake | None = Handshake.client(
                suite=suite, channel=channel, identity=identity, keyring=keyring, random=random)
        else:
            if peer_ip is None:
                raise LocalProtocolError("a server connection needs the peer's IP")
            self._hs = Handshake.server(suite=suite, keyring=keyring, random=random,
                                        source_ip=peer_ip, capacity_ok=capacity_ok)
        self._flush_handshake()

    # -- state ---------------------------------------------------------------------------

    @property
    def established(self) -> bool:
        return self._sender is not None and not self._broken

    @property
    def closed(self) -> bool:
        """Nothing more will be sent or accepted: flush ``data_to_send()`` and close."""
        return self._broken or (self._our_closed and self._their_closed)

    @property
    def awaiting_hello(self) -> bool:
        """A server whose peer has not yet sent its whole ClientHello (and no failure)."""
        return not self._broken and self._hs is not None and self._hs.awaiting_hello

    @property
    def our_closed(self) -> bool:
        return self._our_closed

    @property
    def their_closed(self) -> bool:
        return self._their_closed

    # -- input ---------------------------------------------------------------------------

    def receive_data(self, data: Buffer, now: float) -> None:
        """Feed bytes from the peer (``b""``: end of stream). Events queue for ``next_event``."""
        if self._broken:
            raise LocalProtocolError("the connection is broken; close it")
        try:
            self._check_deadline(now)
            if not data:
                self._receive_eof()
            elif self._their_closed:
                raise RemoteProtocolError("data after the peer's close frame",
                                          kind="frame_after_close")
            elif self._hs is not None:
                self._receive_handshake(bytes(data))
            else:
                self._receive_frames(data)
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise

    def handle_timer(self, now: float) -> None:
        """Raise ``RemoteProtocolError`` (handshake_timeout) once the handshake is overdue."""
        if self._broken:
            return
        try:
            self._check_deadline(now)
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise

    def next_deadline(self) -> float | None:
        if self._broken:
            return None
        hello, whole = self._hello_deadline, self._deadline
        if hello is not None and self.awaiting_hello:
            return hello if whole is None else min(hello, whole)
        return whole

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    # -- output --------------------------------------------------------------------------

    def send_message(self, payload: Buffer) -> None:
        self._out.append(self._ready_sender().seal(Kind.MESSAGE, payload))

    def key_update(self) -> None:
        """Send a key update now (the sender also does so on its own at its limits)."""
        self._out.append(self._ready_sender().key_update())

    def close(self, reason: str = "") -> None:
        """Send a close frame; nothing may be sent after it."""
        encoded = reason.encode("utf-8")
        if len(encoded) > MAX_CLOSE_REASON:
            raise LocalProtocolError("a close reason is at most 1 KiB of UTF-8")
        self._out.append(self._ready_sender().seal(Kind.CLOSE, encoded))
        self._our_closed = True

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    def buffers_to_send(self) -> list[bytes | bytearray]:
        """What ``data_to_send`` would join, one buffer per frame (or handshake flight),
        each ours no more: write them as they are, with no copy."""
        out, self._out = self._out, []
        return out

    # -- internals -----------------------------------------------------------------------

    def _ready_sender(self) -> FrameSender:
        if self._sender is None:
            raise LocalProtocolError("nothing can be sent before the handshake completes")
        if self._broken:
            raise LocalProtocolError("the connection is broken")
        if self._our_closed:
            raise LocalProtocolError("the connection is closed on our side")
        return self._sender

    def _check_deadline(self, now: float) -> None:
        if self._deadline is not None and now >= self._deadline:
            raise RemoteProtocolError("the handshake did not finish in time",
                                      kind="handshake_timeout")
        hello = self._hello_deadline
        if hello is not None and now >= hello and self.awaiting_hello:
            raise RemoteProtocolError("the client sent no complete ClientHello in time",
                                      kind="hello_timeout")

    def _fail(self, exc: RemoteProtocolError) -> None:
        self._broken = True
        self._deadline = self._hello_deadline = None
        self._flush_handshake()
        if self._sender is not None and not self._our_closed:
            reason = exc.reason.encode("utf-8")[:MAX_CLOSE_REASON].decode("utf-8", "ignore")
            self._out.append(self._sender.seal(Kind.CLOSE, reason.encode("utf-8")))
            self._our_closed = True

    def _flush_handshake(self) -> None:
        if self._hs is not None:
            out = self._hs.take_output()
            if out:
                self._out.append(out)

    def _receive_eof(self) -> None:
        if self._their_closed:
            return
        stage = "during the handshake" if self._hs is not None else "without a close frame"
        raise RemoteProtocolError(f"the peer ended the stream {stage}", kind="abort")

    def _receive_handshake(self, data: bytes) -> None:
        hs = self._hs
        assert hs is not None
        rest = hs.feed(data)
        self._flush_handshake()
        result = hs.result
        if result is None:
            return
        self._hs = None
        self._deadline = self._hello_deadline = None
        if result.verdict != VERDICT_ACCEPTED:  # only a server gets here with verdict 1
            self._events.append(HandshakeRefused("at capacity"))
            self._our_closed = self._their_closed = True
            return
        self._sender = FrameSender(result.suite, result.send_secret, self._limits)
        self._receiver = FrameReceiver(result.suite, result.recv_secret, self._limits)
        self._events.append(HandshakeComplete(result.peer_identity, result.key_id,
                                              result.channel))
        if rest:
            self._receive_frames(rest)

    def _receive_frames(self, data: Buffer) -> None:
        receiver = self._receiver
        assert receiver is not None
        receiver.feed(data)
        while (frame := receiver.next_frame()) is not None:
            if frame.kind is Kind.MESSAGE:
                self._events.append(MessageReceived(frame.payload))
            elif frame.kind is Kind.KEY_UPDATE:
                self._events.append(KeyUpdated())
            else:
                self._their_closed = True
                self._events.append(PeerClosed(frame.payload.decode("utf-8")))
                if receiver.buffered:
                    raise RemoteProtocolError("data after the peer's close frame",
                                              kind="frame_after_close")
                return
