"""Two sans-IO connections over a fake link: handshakes, messages, close, rekey, refusals."""

from __future__ import annotations

import os
import struct
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from mlxceld.wire import (
    Channel,
    Connection,
    ConnectionRole,
    FrameLimits,
    HandshakeComplete,
    KeyUpdated,
    LocalProtocolError,
    MessageReceived,
    PeerClosed,
    RemoteProtocolError,
    Suite,
    key_id,
)
from mlxceld.wire.hello import ClientHello

from helpers.keys import keyring
from helpers.wire import (
    IDENTITY,
    OTHER_SECRET,
    SECRET,
    SOURCE_IP,
    VECTORS,
    connected,
    drain,
    h,
    make_pair,
    pump,
    shuttle,
    vector_randoms,
)

SUITES = [Suite.AES_256_GCM, Suite.CHACHA20_POLY1305]


def refused(kind: str) -> Any:
    class Match:
        def __init__(self) -> None:
            self.ctx = pytest.raises(RemoteProtocolError)

        def __enter__(self) -> Any:
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc: Any) -> bool:
            out = self.ctx.__exit__(*exc)
            assert self.info.value.kind == kind, self.info.value
            return bool(out)

    return Match()


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
@pytest.mark.parametrize("channel", list(Channel), ids=lambda c: c.name)
def test_byte_by_byte_handshake_messages_and_close(suite: Suite, channel: Channel) -> None:
    client, server = make_pair(channel=channel, suite=suite)
    assert client.next_deadline() == server.next_deadline() == 5.0
    shuttle(client, server)
    assert drain(client) == [HandshakeComplete(None, key_id(SECRET), channel)]
    assert drain(server) == [HandshakeComplete(IDENTITY, key_id(SECRET), channel)]
    assert client.next_deadline() is None and server.next_deadline() is None
    client.send_message(b"ping")
    server.send_message(b"")
    server.send_message(bytes(range(256)) * 100)
    shuttle(client, server)
    assert drain(server) == [MessageReceived(b"ping")]
    assert drain(client) == [MessageReceived(b""), MessageReceived(bytes(range(256)) * 100)]
    client.close("bye")
    pump(client, server)
    assert drain(server) == [PeerClosed("bye")]
    server.close("bye too")
    pump(server, client)
    assert drain(client) == [PeerClosed("bye too")]
    assert client.closed and server.closed
    client.receive_data(b"", 1.0)  # the end of stream after a close frame is clean
    with pytest.raises(LocalProtocolError):
        client.send_message(b"late")


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_key_updates_at_lowered_limits_both_ways(suite: Suite) -> None:
    limits = FrameLimits(send_frames=4, send_bytes=300, recv_frames=16, recv_bytes=1200)
    client, server = connected(suite=suite, limits=limits)
    for sender, receiver in ((client, server), (server, client)):
        payloads = [bytes([i]) * (i * 7 % 90) for i in range(40)]
        for p in payloads:
            sender.send_message(p)
        pump(sender, receiver, bytewise=False)
        events = drain(receiver)
        assert [e.payload for e in events if isinstance(e, MessageReceived)] == payloads
        assert sum(isinstance(e, KeyUpdated) for e in events) >= 10


def test_receiver_closes_a_peer_that_does_not_rekey() -> None:
    client, server = connected(client_limits=FrameLimits(),
                               server_limits=FrameLimits(recv_frames=3))
    for _ in range(4):
        client.send_message(b"x")
    with refused("key_limit_exceeded"):
        pump(client, server, bytewise=False)
    assert drain(server) == [MessageReceived(b"x")] * 3


def test_receiver_byte_limit() -> None:
    client, server = connected(server_limits=FrameLimits(recv_bytes=100))
    client.send_message(bytes(50))
    pump(client, server)
    client.send_message(bytes(50))
    with refused("key_limit_exceeded"):
        pump(client, server)


# -- refusals during the handshake ------------------------------------------------------

class MisfiledKeyring:
    """A server keyring that files another secret under the client's key id."""

    def __init__(self, secret: bytes) -> None:
        self.primary, self.primary_id = secret, key_id(SECRET)

    def get(self, kid: bytes) -> bytes | None:
        return self.primary if kid == key_id(SECRET) else None


def test_wrong_secret_seen_by_client() -> None:
    client, server = make_pair(server_keyring=MisfiledKeyring(OTHER_SECRET))
    pump(client, server)
    with refused("wrong_secret_client") as err:
        pump(server, client)
    assert "different cluster secret" in str(err.value)
    assert client.data_to_send() == b""  # no ClientAuth


def test_wrong_secret_seen_by_server() -> None:
    client, server = make_pair()
    pump(client, server)
    pump(server, client)
    auth = bytearray(client.data_to_send())
    auth[7] ^= 0x10
    with refused("wrong_secret_server") as err:
        server.receive_data(bytes(auth), 0)
    assert "client most likely holds a different" in str(err.value)
    assert server.data_to_send() == b""  # closed without a verdict
    with refused("abort"):
        client.receive_data(b"", 0)


def test_verdict_tag_must_verify() -> None:
    v = VECTORS["handshakes"][0]
    client, server = make_pair(randoms=vector_randoms(v))
    pump(client, server)
    pump(server, client)
    pump(client, server)
    verdict = bytearray(server.data_to_send())
    verdict[-1] ^= 1
    with refused("wrong_secret_client") as err:
        client.receive_data(bytes(verdict), 0)
    assert "verdict does not verify under the cluster secret" in str(err.value)
    # Verdict 1 under the accept tag does not verify either.
    client, server = make_pair(randoms=vector_randoms(v))
    pump(client, server)
    pump(server, client)
    with refused("wrong_secret_client"):
        client.receive_data(b"\x01" + bytes.fromhex(v["verdict_tags"]["0"]), 0)


def _hello(**changes: Any) -> bytes:
    fields: dict[str, Any] = dict(version=1, suite=1, channel=1, key_id=key_id(SECRET),
                                  nonce=bytes(32), share=bytes(range(1, 33)), identity=IDENTITY)
    fields.update(changes)
    return ClientHello(**fields).encode()


def _server(peer_ip: str = "127.0.0.2", suite: Suite = Suite.AES_256_GCM) -> Connection:
    import os
    return Connection(ConnectionRole.SERVER, keyring=keyring(SECRET), random=os.urandom, now=0,
                      peer_ip=peer_ip, suite=suite)


@pytest.mark.parametrize(("hello", "kind", "answer"), [
    (_hello(version=2), "version_mismatch", "0101"),
    (_hello(version=0, suite=9), "version_mismatch", "0101"),
    (_hello(suite=2), "suite_mismatch", "0201"),
    (_hello(suite=0), "suite_mismatch", "0201"),  # the benchmark suite is never negotiable
    (_hello(key_id=bytes(8)), "unknown_key_id", "0301"),
    (_hello(identity="10.0.0.1:19100"), "identity_not_owned", "0401"),
    (_hello(identity="node-b.local:19100"), "identity_not_owned", "0401"),
    (_hello(identity="[::1]:19100"), "identity_not_owned", "0401"),
    (b"MXCX" + _hello()[4:], "noise", ""),
    (_hello()[:7] + b"\x01" + _hello()[8:], "noise", ""),  # flags
    (_hello(channel=4), "noise", ""),
    (_hello(identity="127.0.0.2"), "noise", ""),
    (_hello(identity="127.0.0.2:0"), "noise", ""),
    (_hello(identity="127.0.0.2:019100"), "noise", ""),
    (_hello(identity="::1:19100"), "noise", ""),
    (_hello()[:82] + b"\xff" * 15, "noise", ""),
    (_hello()[:80] + b"\x00\x00", "noise", ""),  # empty identity
    (_hello(share=bytes(32)), "invalid_share", ""),  # all-zero dh
])
def test_server_refuses_hello(hello: bytes, kind: str, answer: str) -> None:
    server = _server()
    with refused(kind):
        for i in range(len(hello)):
            server.receive_data(hello[i:i + 1], 0)
    assert server.data_to_send().hex() == answer
    with pytest.raises(LocalProtocolError):
        server.receive_data(b"more", 0)


def test_checks_go_in_order() -> None:
    # version before suite before key id before identity
    bad_all = _hello(version=3, suite=2, key_id=bytes(8), identity="10.1.1.1:1")
    with refused("version_mismatch"):
        _server().receive_data(bad_all, 0)
    with refused("suite_mismatch"):
        _server().receive_data(_hello(suite=2, key_id=bytes(8), identity="10.1.1.1:1"), 0)
    with refused("unknown_key_id"):
        _server().receive_data(_hello(key_id=bytes(8), identity="10.1.1.1:1"), 0)


@pytest.mark.parametrize(("identity", "peer_ip"), [
    ("0.0.0.0:19100", "10.1.2.3"),
    ("[::]:19100", "fe80::1%eth0"),
    ("10.1.2.3:19100", "::ffff:10.1.2.3"),
    ("[::ffff:10.1.2.3]:19100", "10.1.2.3"),
    ("[2001:db8::7]:19100", "2001:db8::7"),
])
def test_identity_matches_source(identity: str, peer_ip: str) -> None:
    client, server = make_pair(identity=identity, peer_ip=peer_ip)
    shuttle(client, server)
    assert drain(server) == [HandshakeComplete(identity, key_id(SECRET), Channel.TRANSPORT)]


def test_server_reads_no_more_than_a_hello_and_client_auth() -> None:
    server = _server()
    with refused("noise"):
        server.receive_data(_hello(identity="1" * 255) + bytes(33), 0)
    client, server = make_pair()
    pump(client, server)
    pump(server, client)
    with refused("noise"):
        server.receive_data(client.data_to_send() + b"\x01", 0)
    assert server.data_to_send() == b""


def test_client_refuses_all_zero_server_share() -> None:
    client, _server_conn = make_pair()
    client.data_to_send()
    with refused("invalid_share"):
        client.receive_data(b"\x00\x01" + bytes(32) + bytes(32) + bytes(32), 0)


@pytest.mark.parametrize("role", ["client", "server"])
def test_handshake_timer(role: str) -> None:
    client, server = make_pair(now=100.0)
    conn = client if role == "client" else server
    pump(client, server, 101.0)
    assert conn.next_deadline() == 105.0
    conn.handle_timer(104.999)
    with refused("handshake_timeout"):
        conn.handle_timer(105.0)
    assert conn.next_deadline() is None
    conn.handle_timer(200.0)  # once broken, the timer is quiet


def test_hello_deadline_on_a_server() -> None:
    """A server given ``hello_timeout`` wants the ClientHello by then, the rest by 5 s."""
    client, _ = make_pair(now=100.0)
    hello = client.data_to_send()

    def server() -> Connection:
        return Connection(ConnectionRole.SERVER, keyring=keyring(SECRET), random=os.urandom,
                          now=100.0,
                          peer_ip=SOURCE_IP, hello_timeout=1.0)

    silent = server()
    assert silent.awaiting_hello and silent.next_deadline() == 101.0
    silent.handle_timer(100.999)
    with refused("hello_timeout"):
        silent.handle_timer(101.0)
    assert silent.next_deadline() is None and not silent.awaiting_hello
    dribbling = server()
    dribbling.receive_data(hello[:50], 100.5)  # part of the hello does not move the deadline
    assert dribbling.awaiting_hello and dribbling.next_deadline() == 101.0
    with refused("hello_timeout"):
        dribbling.receive_data(hello[50:], 101.2)
    prompt = server()
    prompt.receive_data(hello, 100.5)
    assert not prompt.awaiting_hello and prompt.next_deadline() == 105.0
    prompt.handle_timer(104.0)  # past the hello deadline: no longer its concern
    with refused("handshake_timeout"):
        prompt.handle_timer(105.0)
    short = Connection(ConnectionRole.SERVER, keyring=keyring(SECRET), random=os.urandom, now=100.0,
                       peer_ip=SOURCE_IP, hello_timeout=9.0)
    assert short.next_deadline() == 105.0  # the whole handshake's bound comes first
    with refused("handshake_timeout"):
        short.handle_timer(105.0)


def test_a_second_installed_key_is_accepted() -> None:
    """The server holds SECRET (primary) and OTHER_SECRET; a client whose primary is the
    second one connects, and both sides agree on its key id."""
    client, server = make_pair(client_keyring=keyring(OTHER_SECRET),
                               server_keyring=keyring(SECRET, OTHER_SECRET))
    shuttle(client, server, bytewise=False)
    assert client.established and server.established
    (done,) = drain(server)
    assert isinstance(done, HandshakeComplete) and done.key_id == key_id(OTHER_SECRET)
    assert key_id(OTHER_SECRET) != keyring(SECRET, OTHER_SECRET).primary_id
    client.send_message(b"under the second key")
    pump(client, server)
    assert drain(server) == [MessageReceived(b"under the second key")]


def test_late_bytes_fail_the_handshake() -> None:
    client, server = make_pair()
    with refused("handshake_timeout"):
        server.receive_data(client.data_to_send(), 5.5)


# -- frames under attack ----------------------------------------------------------------

def _sent(conn: Connection, payload: bytes) -> bytes:
    conn.send_message(payload)
    return conn.data_to_send()


@pytest.mark.parametrize(("offset", "bit", "kind"), [
    (0, 0x02, "frame_auth_failed"),      # kind 0x01 -> 0x03
    (4, 0x02, "frame_auth_failed"),      # length 46 -> 44, shorter
    (1, 0x80, "oversized_frame"),        # length huge
    (10, 0x04, "frame_auth_failed"),     # ciphertext
    (-1, 0x80, "frame_auth_failed"),     # tag
])
def test_flipped_bit(offset: int, bit: int, kind: str) -> None:
    client, server = connected()
    frame = bytearray(_sent(client, b"a message of some thirty bytes"))
    frame[offset] ^= bit
    with refused(kind):
        server.receive_data(bytes(frame), 0)
    assert server.closed and drain(server) == []


def test_replayed_swapped_and_dropped_frames() -> None:
    client, server = connected()
    one, two = _sent(client, b"one"), _sent(client, b"two")
    server.receive_data(one, 0)
    with refused("frame_auth_failed"):
        server.receive_data(one, 0)
    client, server = connected()
    one, two = _sent(client, b"one"), _sent(client, b"two")
    with refused("frame_auth_failed"):
        server.receive_data(two + one, 0)
    client, server = connected()
    _sent(client, b"one")
    with refused("frame_auth_failed"):
        server.receive_data(_sent(client, b"two"), 0)


def test_frame_from_another_connection() -> None:
    client_a, _server_a = connected()
    _client_b, server_b = connected()
    with refused("frame_auth_failed"):
        server_b.receive_data(_sent(client_a, b"hello"), 0)


@pytest.mark.parametrize("max_len", [None, 1000])
def test_oversized_length_refused_from_the_header_alone(max_len: int | None) -> None:
    limits = FrameLimits() if max_len is None else FrameLimits(max_frame_len=max_len)
    client, server = connected(limits=limits)
    too_big = limits.max_frame_len + 1
    with refused("oversized_frame"):
        server.receive_data(struct.pack(">BI", 1, too_big), 0)
    # A frame exactly at the limit is fine.
    client, server = connected(limits=FrameLimits(max_frame_len=100))
    client.send_message(bytes(84))
    pump(client, server)
    assert drain(server) == [MessageReceived(bytes(84))]
    with pytest.raises(LocalProtocolError):
        client.send_message(bytes(85))


def _forge(v: dict[str, Any], kind: int, payload: bytes, seq: int = 0) -> bytes:
    """A c2s frame sealed independently of our frame code, under the vector's keys."""
    aead = (AESGCM if v["suite"] == 1 else ChaCha20Poly1305)(h(v, "key_c2s"))
    nonce = (int.from_bytes(h(v, "iv_c2s"), "big") ^ seq).to_bytes(12, "big")
    header = struct.pack(">BI", kind, len(payload) + 16)
    return header + aead.encrypt(nonce, payload, header)


def _vector_pair(v: dict[str, Any]) -> tuple[Connection, Connection]:
    client, server = make_pair(channel=Channel(v["channel"]), suite=Suite(v["suite"]),
                               randoms=vector_randoms(v))
    shuttle(client, server)
    drain(client)
    drain(server)
    return client, server


@pytest.mark.parametrize("v", VECTORS["handshakes"][::3], ids=["suite1", "suite2"])
def test_unknown_and_malformed_authenticated_frames(v: dict[str, Any]) -> None:
    _c, server = _vector_pair(v)
    server.receive_data(_forge(v, 0x01, b"forged but valid"), 0)
    assert drain(server) == [MessageReceived(b"forged but valid")]
    with refused("unknown_frame_kind"):
        server.receive_data(_forge(v, 0x05, b"", seq=1), 0)
    for kind, payload in ((0x0F, b"x"), (0x02, b"\xff"), (0x02, b"r" * 1025)):
        _c, server = _vector_pair(v)
        with refused("malformed_frame"):
            server.receive_data(_forge(v, kind, payload), 0)


def test_errors_after_the_handshake_send_a_close_frame() -> None:
    client, server = connected()
    with refused("oversized_frame"):
        server.receive_data(struct.pack(">BI", 1, 2**32 - 1), 0)
    client.receive_data(server.data_to_send(), 0)
    [closed] = drain(client)
    assert isinstance(closed, PeerClosed) and "exceeds the maximum" in closed.reason


def test_eof_without_close_is_an_abort() -> None:
    client, server = connected()
    with refused("abort"):
        server.receive_data(b"", 0)
    client, server = make_pair()
    pump(client, server)
    with refused("abort"):
        server.receive_data(b"", 0)


def test_data_after_close_frame() -> None:
    client, server = connected()
    client.close("done")
    data = client.data_to_send()
    with refused("frame_after_close"):
        server.receive_data(data + b"\x01", 0)
    assert drain(server) == [PeerClosed("done")]


def test_local_misuse() -> None:
    client, _server = make_pair()
    with pytest.raises(LocalProtocolError):
        client.send_message(b"too early")
    with pytest.raises(LocalProtocolError):
        client.close()
    with pytest.raises(LocalProtocolError):
        Connection(ConnectionRole.CLIENT, keyring=keyring(SECRET), random=bytes, now=0)
    with pytest.raises(LocalProtocolError):
        Connection(ConnectionRole.SERVER, keyring=keyring(SECRET), random=bytes, now=0,
                   peer_ip="::1",
                   suite=Suite.UNPROTECTED)
    client, _server = connected()
    with pytest.raises(LocalProtocolError):
        client.close("x" * 1025)
    client.close()
    with pytest.raises(LocalProtocolError):
        client.close()


def test_frames_in_the_same_chunk_as_the_verdict() -> None:
    client, server = make_pair()
    pump(client, server)
    pump(server, client)
    pump(client, server)
    server.send_message(b"right away")
    client.receive_data(server.data_to_send(), 0)
    assert drain(client)[1:] == [MessageReceived(b"right away")]


def test_unprotected_suite_for_benchmarks_only() -> None:
    from mlxceld.wire import FrameReceiver, FrameSender, Kind

    sender, receiver = FrameSender(Suite.UNPROTECTED, bytes(32)), FrameReceiver(
        Suite.UNPROTECTED, bytes(32))
    frame = sender.seal(Kind.MESSAGE, b"plain")
    assert frame == b"\x01\x00\x00\x00\x15plain" + bytes(16)
    receiver.feed(frame)
    opened = receiver.next_frame()
    assert opened is not None and opened.payload == b"plain"
    with pytest.raises(LocalProtocolError):
        make_pair(suite=Suite.UNPROTECTED)
