"""The message envelope (section 4), mx.array blobs, and discovery records (section 5)."""

from __future__ import annotations

import struct

import pytest

from mlxceld.wire import (
    BeaconError,
    EnvelopeError,
    MessageSpec,
    TensorSpec,
    build_record,
    encode_envelope,
    parse_envelope,
    verify_record,
)

from helpers.keys import keyring
from helpers.wire import OTHER_SECRET, SECRET, VECTORS

F16 = frozenset({"f16"})
SPECS = {
    "ping": MessageSpec(),
    "activation": MessageSpec({"h": TensorSpec(F16, ((1, 1), (1, 8), (4, 4))),
                               "ids": TensorSpec(frozenset({"i32"}), ((1, 8),), required=False)}),
}


def test_vector_payloads_parse_and_reencode() -> None:
    for frame in VECTORS["handshakes"][0]["frames_s2c"][:2]:
        payload = bytes.fromhex(frame["payload"])
        env = parse_envelope(payload, {**SPECS, "pong": MessageSpec()})
        blobs = [(t.name, t.dtype, t.shape, t.data) for t in env.tensors.values()]
        header = {k: v for k, v in env.header.items() if k != "tensors"}
        assert encode_envelope(header, blobs) == payload
    env = parse_envelope(payload, SPECS)
    assert env.type == "activation" and env.header["id"] == 7
    h = env.tensors["h"]
    assert (h.dtype, h.shape, bytes(h.data)) == ("f16", (1, 2, 4), bytes(range(16)))
    assert h.data.obj is payload  # a view, not a copy


def _payload(header: bytes, blobs: bytes = b"") -> bytes:
    return struct.pack(">I", len(header)) + header + blobs


@pytest.mark.parametrize("payload", [
    b"", b"\x00\x00", _payload(b"[]"), _payload(b'{"t": 1}'), _payload(b"{}"),
    _payload(b'{"t":"ping"}', b"x"),  # trailing bytes
    _payload(b'{"t":"ping","t":"ping"}'),  # duplicate key
    _payload(b'{"t":"ping","x":NaN}'),
    _payload('{"t":"ping"}'.encode("utf-16")),
    _payload(b'{"t":"nope"}'),  # not on the allow-list
    struct.pack(">I", 99) + b'{"t":"ping"}',
    _payload(b'{"t":"activation"}'),  # required tensor missing
    _payload(b'{"t":"activation","tensors":[{"name":"h","dtype":"f32","shape":[1,2,4]}]}',
             bytes(32)),
    _payload(b'{"t":"activation","tensors":[{"name":"h","dtype":"f16","shape":[1,9,4]}]}',
             bytes(72)),
    _payload(b'{"t":"activation","tensors":[{"name":"h","dtype":"f16","shape":[1,2]}]}',
             bytes(4)),
    _payload(b'{"t":"activation","tensors":[{"name":"h","dtype":"f16","shape":[1,2,4]}]}',
             bytes(15)),
    _payload(b'{"t":"activation","tensors":[{"name":"h","dtype":"f16","shape":[1,2,true]}]}'),
    _payload(b'{"t":"activation","tensors":[{"name":"x","dtype":"f16","shape":[1]}]}', b"ab"),
    _payload(b'{"t":"activation","tensors":[{"name":"h","dtype":"f16","shape":[1,2,4],"a":1}]}',
             bytes(16)),
    _payload(b'{"t":"activation","tensors":{"name":"h"}}'),
])
def test_envelope_refusals(payload: bytes) -> None:
    with pytest.raises(EnvelopeError):
        parse_envelope(payload, SPECS)


def test_envelope_encoder_checks_buffers() -> None:
    with pytest.raises(ValueError):
        encode_envelope({"t": "activation"}, [("h", "f16", (1, 2, 4), bytes(15))])
    with pytest.raises(ValueError):
        encode_envelope({"id": 1})
    payload = encode_envelope({"t": "activation"},
                              [("h", "f16", (1, 1, 4), bytes(8)), ("ids", "i32", (2,), bytes(8))])
    assert set(parse_envelope(payload, SPECS).tensors) == {"h", "ids"}


def test_mx_arrays_round_trip() -> None:
    mx = pytest.importorskip("mlx.core")
    from mlxceld.wire.mx_tensors import from_blob, to_blob

    dtypes = ["float32", "float16", "bfloat16", "int32", "int16", "int8", "uint8", "uint32"]
    spec = MessageSpec({d: TensorSpec(frozenset({"f32", "f16", "bf16", "i32", "i16", "i8", "u8",
                                                 "u32"}), ((0, 9), (0, 9))) for d in dtypes})
    arrays = {d: mx.arange(12).reshape(4, 3).T.astype(getattr(mx, d)) for d in dtypes}
    payload = encode_envelope({"t": "all"}, [to_blob(d, a) for d, a in arrays.items()])
    env = parse_envelope(payload, {"all": spec})
    for d, a in arrays.items():
        b = from_blob(env.tensors[d])
        assert b.dtype == a.dtype and b.shape == a.shape and mx.array_equal(a, b).item()


FIELDS = VECTORS["beacon"]["fields"]
NOW = int(FIELDS["ts"])


def _record(**changes: str) -> dict[str, str]:
    record = build_record(SECRET, version="1", package_version="0.1.0", cluster="mlxcel-cluster",
                          node="host-b", addr="192.0.2.11:19000", ts=NOW, nonce=bytes(16))
    return record | changes


def _verify(record: dict[str, str], now: float = NOW) -> dict[str, str]:
    return verify_record(record, keyring(SECRET), version="1", package_version="0.1.0",
                         cluster="mlxcel-cluster", now=now)


def test_beacon_verifies() -> None:
    record = {**FIELDS, "mac": VECTORS["beacon"]["mac"]}
    assert _verify(record, NOW - 60) == record
    assert _verify(_record(), NOW + 60)


@pytest.mark.parametrize(("record", "now"), [
    (_record(), NOW + 61),
    (_record(), NOW - 61),
    (_record(node="host-c"), NOW),  # MAC no longer matches
    (_record(mac="0" * 64), NOW),
    (_record(mac="A" * 64), NOW),
    (_record(kid="00" * 8), NOW),
    (_record(ts="+1767225600"), NOW),
    ({k: v for k, v in _record().items() if k != "addr"}, NOW),
    (_record(extra="1"), NOW),
])
def test_beacon_refusals(record: dict[str, str], now: int) -> None:
    with pytest.raises(BeaconError):
        _verify(record, now)


@pytest.mark.parametrize(("field", "value"), [("v", "2"), ("ver", "0.2.0"), ("cluster", "x")])
def test_beacon_from_elsewhere(field: str, value: str) -> None:
    kwargs = {"version": "1", "package_version": "0.1.0", "cluster": "mlxcel-cluster"}
    kwargs[{"v": "version", "ver": "package_version", "cluster": "cluster"}[field]] = value
    record = build_record(SECRET, node="n", addr="10.0.0.1:1", ts=NOW, nonce=bytes(16),
                          **kwargs)
    with pytest.raises(BeaconError):
        _verify(record)
    other = build_record(OTHER_SECRET, version="1", package_version="0.1.0",
                         cluster="mlxcel-cluster", node="n", addr="10.0.0.1:1", ts=NOW,
                         nonce=bytes(16))
    with pytest.raises(BeaconError):
        _verify(other)
