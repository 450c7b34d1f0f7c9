"""Every value in vectors/mxcl-v1.json, reproduced byte for byte."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.wire import (
    Channel,
    FrameReceiver,
    FrameSender,
    HandshakeComplete,
    HandshakeRefused,
    Kind,
    MessageReceived,
    PeerClosed,
    RemoteProtocolError,
    SecretError,
    Suite,
    beacon_key,
    beacon_mac,
    build_record,
    canonical,
    check_secret,
    key_id,
    trim_secret_file,
)
from mlxceld.wire import schedule as ks
from mlxceld.wire.crypto import x25519, x25519_public
from mlxceld.wire.handshake import Handshake

from helpers.keys import keyring
from helpers.wire import (
    IDENTITY,
    SECRET,
    SOURCE_IP,
    VECTORS,
    drain,
    h,
    make_pair,
    vector_randoms,
)

HANDSHAKES = VECTORS["handshakes"]
IDS = [f"suite{v['suite']}-channel{v['channel']}" for v in HANDSHAKES]


@pytest.mark.parametrize("case", VECTORS["secret_file_trim"])
def test_secret_file_trim(case: dict[str, str]) -> None:
    trimmed = trim_secret_file(bytes.fromhex(case["file_hex"]))
    if "error" in case:
        with pytest.raises(SecretError, match=case["error"]):
            check_secret(trimmed)
    else:
        assert check_secret(trimmed) == bytes.fromhex(case["secret_hex"])


def test_key_id() -> None:
    assert key_id(SECRET).hex() == VECTORS["key_id"]


@pytest.mark.parametrize("v", HANDSHAKES, ids=IDS)
def test_key_schedule(v: dict[str, Any]) -> None:
    assert v["identity"] == IDENTITY
    ch, shh = h(v, "client_hello"), h(v, "server_hello_head")
    cpub = x25519_public(h(v, "client_ephemeral_private"))
    spub = x25519_public(h(v, "server_ephemeral_private"))
    assert ch[:4] == b"MXCL" and ch[4:8] == bytes([1, v["suite"], v["channel"], 0])
    assert ch[8:16] == key_id(SECRET)
    assert ch[16:48] == h(v, "client_nonce") and ch[48:80] == cpub
    assert ch[80:82] == len(IDENTITY).to_bytes(2, "big") and ch[82:] == IDENTITY.encode()
    assert shh == bytes([0, 1]) + h(v, "server_nonce") + spub
    dh = x25519(h(v, "client_ephemeral_private"), spub)
    assert dh == x25519(h(v, "server_ephemeral_private"), cpub) == h(v, "x25519_shared")
    prk = ks.prk(h(v, "client_nonce"), h(v, "server_nonce"), SECRET, dh)
    assert prk == h(v, "prk")
    k_s, k_c = ks.auth_keys(prk)
    assert (k_s, k_c) == (h(v, "auth_key_server"), h(v, "auth_key_client"))
    assert ks.server_auth(k_s, ch, shh) == h(v, "server_auth")
    sh = shh + h(v, "server_auth")
    assert ks.client_auth(k_c, ch, sh) == h(v, "client_auth")
    for verdict, tag in v["verdict_tags"].items():
        assert ks.verdict_tag(k_s, ch, sh, h(v, "client_auth"), int(verdict)).hex() == tag
    assert h(v, "verdict_accept") == b"\x00" + bytes.fromhex(v["verdict_tags"]["0"])
    th = ks.transcript_hash(ch, sh, h(v, "client_auth"), h(v, "verdict_accept"))
    assert th == h(v, "transcript_hash")
    c2s, s2c = ks.traffic_secrets(prk, Channel(v["channel"]), th)
    assert (c2s, s2c) == (h(v, "traffic_c2s"), h(v, "traffic_s2c"))
    assert ks.traffic_key_iv(c2s) == (h(v, "key_c2s"), h(v, "iv_c2s"))
    assert ks.traffic_key_iv(s2c) == (h(v, "key_s2c"), h(v, "iv_s2c"))
    assert ks.next_traffic_secret(c2s) == h(v, "traffic_c2s_after_update")


def _frame_kind(frame: dict[str, Any]) -> Kind:
    return {"key_update": Kind.KEY_UPDATE, "close": Kind.CLOSE}.get(frame.get("kind", ""),
                                                                    Kind.MESSAGE)


@pytest.mark.parametrize("v", HANDSHAKES, ids=IDS)
@pytest.mark.parametrize("direction", ["c2s", "s2c"])
def test_frames(v: dict[str, Any], direction: str) -> None:
    suite, secret = Suite(v["suite"]), h(v, f"traffic_{direction}")
    sender, receiver = FrameSender(suite, secret), FrameReceiver(suite, secret)
    updated = False
    for frame in v[f"frames_{direction}"]:
        assert sender.seq == frame["seq"]
        assert frame.get("after_key_update", False) == updated
        kind, payload = _frame_kind(frame), bytes.fromhex(frame["payload"])
        if kind is Kind.KEY_UPDATE:
            out = sender.key_update()
            updated = True
        else:
            out = sender.seal(kind, payload)
        assert out.hex() == frame["frame"]
        receiver.feed(out)
        opened = receiver.next_frame()
        assert opened is not None and opened.kind is kind and opened.payload == payload
        assert receiver.buffered == 0


@pytest.mark.parametrize("v", HANDSHAKES, ids=IDS)
def test_handshake_state_machines_byte_by_byte(v: dict[str, Any]) -> None:
    crand, srand = vector_randoms(v)
    client = Handshake.client(suite=Suite(v["suite"]), channel=Channel(v["channel"]),
                              identity=v["identity"], keyring=keyring(SECRET), random=crand)
    server = Handshake.server(suite=Suite(v["suite"]), keyring=keyring(SECRET), random=srand,
                              source_ip=SOURCE_IP)
    hello = client.take_output()
    assert hello == h(v, "client_hello")
    for i in range(len(hello)):
        assert server.feed(hello[i:i + 1]) == b""
    server_hello = server.take_output()
    assert server_hello == h(v, "server_hello_head") + h(v, "server_auth")
    for i in range(len(server_hello)):
        client.feed(server_hello[i:i + 1])
    assert client.take_output() == h(v, "client_auth")
    server.feed(h(v, "client_auth"))
    assert server.take_output() == h(v, "verdict_accept")
    client.feed(h(v, "verdict_accept"))
    assert client.result is not None and server.result is not None
    assert client.result.send_secret == server.result.recv_secret == h(v, "traffic_c2s")
    assert client.result.recv_secret == server.result.send_secret == h(v, "traffic_s2c")
    assert server.result.peer_identity == IDENTITY
    assert server.result.key_id == client.result.key_id == key_id(SECRET)
    # Ephemeral private keys, PRK, Ks and Kc are gone after the handshake.
    for hs in (client, server):
        assert hs._private == hs._prk == hs._ks == hs._kc == hs._secret == b""


@pytest.mark.parametrize("v", HANDSHAKES, ids=IDS)
def test_connections_reproduce_handshake_and_frames(v: dict[str, Any]) -> None:
    client, server = make_pair(channel=Channel(v["channel"]), suite=Suite(v["suite"]),
                               randoms=vector_randoms(v))
    assert client.data_to_send() == h(v, "client_hello")
    server.receive_data(h(v, "client_hello"), 0.1)
    assert server.data_to_send() == h(v, "server_hello_head") + h(v, "server_auth")
    client.receive_data(h(v, "server_hello_head") + h(v, "server_auth"), 0.2)
    assert client.data_to_send() == h(v, "client_auth")
    server.receive_data(h(v, "client_auth"), 0.3)
    assert server.data_to_send() == h(v, "verdict_accept")
    assert drain(server) == [HandshakeComplete(IDENTITY, key_id(SECRET), Channel(v["channel"]))]
    client.receive_data(h(v, "verdict_accept"), 0.4)
    assert drain(client) == [HandshakeComplete(None, key_id(SECRET), Channel(v["channel"]))]
    for sender, receiver, direction in ((client, server, "c2s"), (server, client, "s2c")):
        for frame in v[f"frames_{direction}"]:
            kind, payload = _frame_kind(frame), bytes.fromhex(frame["payload"])
            if kind is Kind.KEY_UPDATE:
                sender.key_update()
            elif kind is Kind.CLOSE:
                sender.close(payload.decode())
            else:
                sender.send_message(payload)
            assert sender.data_to_send().hex() == frame["frame"]
            receiver.receive_data(bytes.fromhex(frame["frame"]), 0.5)
            events = drain(receiver)
            if kind is Kind.MESSAGE:
                assert events == [MessageReceived(payload)]
            elif kind is Kind.CLOSE:
                assert events == [PeerClosed(payload.decode())]
    assert client.their_closed and server.our_closed


@pytest.mark.parametrize("v", HANDSHAKES, ids=IDS)
def test_at_capacity_verdict(v: dict[str, Any]) -> None:
    client, server = make_pair(channel=Channel(v["channel"]), suite=Suite(v["suite"]),
                               randoms=vector_randoms(v), capacity_ok=lambda: False)
    server.receive_data(client.data_to_send(), 0)
    client.receive_data(server.data_to_send(), 0)
    server.receive_data(client.data_to_send(), 0)
    verdict = server.data_to_send()
    assert verdict == b"\x01" + bytes.fromhex(v["verdict_tags"]["1"])
    assert drain(server) == [HandshakeRefused("at capacity")] and server.closed
    with pytest.raises(RemoteProtocolError) as err:
        client.receive_data(verdict, 0)
    assert err.value.kind == "at_capacity"


@pytest.mark.parametrize("case", VECTORS["rejects"], ids=lambda c: c["reason"])
def test_rejects(case: dict[str, Any]) -> None:
    status = case["status"]
    server_suite = Suite.CHACHA20_POLY1305 if status == 2 else Suite.AES_256_GCM
    server_keys = keyring(b"the server's only secret, 33 bytes") if status == 3 else keyring(SECRET)
    client, server = make_pair(server_suite=server_suite, server_keyring=server_keys,
                               peer_ip="10.9.9.9" if status == 4 else SOURCE_IP)
    hello = client.data_to_send()
    if status == 1:
        hello = hello[:4] + b"\x02" + hello[5:]
    with pytest.raises(RemoteProtocolError) as refused:
        server.receive_data(hello, 0)
    answer = server.data_to_send()
    assert answer.hex() == case["server_hello"]
    assert refused.value.kind == case["reason"].replace(" ", "_")
    with pytest.raises(RemoteProtocolError, match=case["reason"]) as seen:
        client.receive_data(answer, 0)
    assert seen.value.kind == refused.value.kind


def test_beacon() -> None:
    b = VECTORS["beacon"]
    fields = b["fields"]
    assert beacon_key(SECRET).hex() == b["beacon_key"]
    assert canonical(fields).decode() == b["canonical"]
    assert beacon_mac(SECRET, fields) == b["mac"]
    record = build_record(SECRET, version=fields["v"], package_version=fields["ver"],
                          cluster=fields["cluster"], node=fields["node"], addr=fields["addr"],
                          ts=int(fields["ts"]), nonce=bytes.fromhex(fields["nonce"]))
    assert record == {**fields, "mac": b["mac"]}


def test_the_local_copy_of_the_vectors_matches_shared() -> None:
    import pytest

    from helpers.wire import LOCAL_VECTORS, SHARED_VECTORS

    if not SHARED_VECTORS.exists():
        pytest.skip(f"{SHARED_VECTORS} is not beside this checkout")
    assert LOCAL_VECTORS.read_bytes() == SHARED_VECTORS.read_bytes()
