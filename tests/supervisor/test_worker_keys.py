"""The keyring op's shape (supervisor/keys.py) and the in-place swap it drives."""

from __future__ import annotations

import pytest

from mlxceld.supervisor.keys import api_key_tag, keys_of, reported_api_key, reported_keys
from mlxceld.supervisor.ops import ApiKeyUpdate, KeyringUpdate, OpError
from mlxceld.wire.secret import Keyring, key_id

A, B = b"a" * 32, b"b" * 32


def test_a_request_round_trips_and_reports_key_ids_only() -> None:
    primary, accepted = KeyringUpdate.from_wire(KeyringUpdate.of(B, [A]).to_wire()).secrets()
    assert (primary, accepted) == (B, [A])
    keys = keys_of(B, [A])
    assert keys == {"primary": key_id(B).hex(), "ids": sorted([key_id(A).hex(),
                                                               key_id(B).hex()])}
    assert reported_keys({"keys": dict(keys)}) == keys
    assert reported_keys({"keys": "x"}) is None


@pytest.mark.parametrize("request_", [
    {}, {"primary_hex": "zz"}, {"primary_hex": (b"short").hex()},
    {"primary_hex": A.hex(), "accepted_hex": "nope"},
    {"primary_hex": A.hex(), "accepted_hex": [B.hex()] * 17},
    {"primary_hex": A.hex(), "accepted_hex": [B.hex()[:-2] + "zz"]},
])
def test_bad_requests_are_named_without_the_secret(request_: dict[str, object]) -> None:
    with pytest.raises(OpError) as err:
        KeyringUpdate.from_wire(request_)
    assert A.hex() not in str(err.value) and B.hex() not in str(err.value)


def test_replace_all_swaps_in_place_and_names_what_it_dropped() -> None:
    ring = Keyring()
    ring.add(A)
    assert ring.replace_all(A, [B]) == []
    assert ring.primary_id == key_id(A) and key_id(B) in ring and ring.others() == [B]
    assert ring.replace_all(B) == [key_id(A)]
    assert ring.primary == B and key_id(A) not in ring and ring.others() == []


def test_the_api_key_op_round_trips_and_never_shows_the_key() -> None:
    key = "sk-secret-123456"
    update = ApiKeyUpdate(key)
    assert ApiKeyUpdate.from_wire(update.to_wire()) == update
    assert ApiKeyUpdate.from_wire({"op": "api_key", "api_key": None}).api_key is None
    assert key not in repr(update)
    for bad in ("short", "two words here", 12345):
        with pytest.raises(OpError) as err:
            ApiKeyUpdate.from_wire({"op": "api_key", "api_key": bad})
        assert err.value.field == "api_key" and str(bad) not in str(err.value)


def test_a_worker_reports_its_api_key_as_a_salted_tag() -> None:
    salt, other = b"s" * 16, b"t" * 16
    tag = api_key_tag("sk-secret-123456", salt)
    assert "sk-secret" not in tag and len(tag) == 64
    assert tag == api_key_tag("sk-secret-123456", salt)  # what the supervisor compares
    assert tag not in (api_key_tag("sk-secret-123457", salt),
                       api_key_tag("sk-secret-123456", other), api_key_tag(None, salt))
    assert reported_api_key({"api_key": {"salt": salt.hex(), "tag": tag}}) == (salt, tag)
    for malformed in ({}, {"api_key": "x"}, {"api_key": {"salt": "zz", "tag": tag}}):
        assert reported_api_key(malformed) is None

