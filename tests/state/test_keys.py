"""The keyring on disk: 0600 files in a 0700 dir, atomic writes, primary rules, no secret in DB."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import sqlite_utils

from mlxceld.errors import KeyringError, PrimaryKeyRemoval, StateError, UnknownKey
from mlxceld.state import SCHEMA_VERSION, KeyStore, open_db, parse_key_id
from mlxceld.state.keys import MAX_RETIRED
from mlxceld.wire.secret import key_id

S1 = b"first-cluster-secret-0123456789"
S2 = b"second-cluster-secret-abcdefghij"
S3 = bytes(range(256))[:40]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def store(db: sqlite_utils.Database, tmp_path: Path) -> KeyStore:
    return KeyStore(db, tmp_path / "keys")


def test_schema_v3_has_the_keys_table(db: sqlite_utils.Database) -> None:
    assert SCHEMA_VERSION >= 3
    assert "keys" in db.table_names()
    assert set(db.table("keys").columns_dict) == {"key_id", "state", "created_at", "source"}


def test_files_are_0600_in_a_0700_dir_and_hold_the_exact_bytes(store: KeyStore) -> None:
    info = store.install(S3, source="test")
    path = store.dir / f"{info.key_id}.key"
    assert mode(store.dir) == 0o700
    assert mode(path) == 0o600
    assert path.read_bytes() == S3
    assert info.key_id == key_id(S3).hex()
    assert [p.name for p in store.dir.iterdir()] == [path.name]  # no temp file left behind


def test_a_too_wide_keys_dir_is_narrowed(db: sqlite_utils.Database, tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir(mode=0o755)
    os.chmod(tmp_path / "keys", 0o755)
    KeyStore(db, tmp_path / "keys")
    assert mode(tmp_path / "keys") == 0o700


def test_write_is_atomic_a_failed_rename_leaves_no_file(store: KeyStore) -> None:
    # A directory where the key file should go makes the rename fail.
    (store.dir / f"{key_id(S1).hex()}.key").mkdir()
    with pytest.raises(StateError, match=key_id(S1).hex()):
        store.install(S1, source="test")
    leftovers = [p.name for p in store.dir.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
    assert store.list() == []


def test_first_key_is_primary_then_primary_moves_on_request(store: KeyStore) -> None:
    k1 = store.install(S1, source="a")
    k2 = store.install(S2, source="b")
    assert (k1.state, k2.state) == ("primary", "installed")
    assert store.keyring.primary == S1
    store.set_primary(key_id(S2))
    states = {k.key_id: k.state for k in store.list()}
    assert states == {k1.key_id: "installed", k2.key_id: "primary"}
    assert store.keyring.primary == S2
    k3 = store.install(S3, source="c", primary=True)
    assert k3.state == "primary" and store.keyring.primary_id == key_id(S3)
    assert [k.state for k in store.list()].count("primary") == 1


def test_install_is_idempotent(store: KeyStore) -> None:
    store.install(S1, source="a")
    again = store.install(S1, source="other")
    assert again.source == "a" and len(store.list()) == 1 and len(store.keyring) == 1


def test_the_primary_cannot_be_removed_and_the_error_says_what_to_do(store: KeyStore) -> None:
    store.install(S1, source="a")
    with pytest.raises(PrimaryKeyRemoval) as info:
        store.remove(key_id(S1))
    assert key_id(S1).hex() in info.value.message
    assert "mlxctl secret install" in info.value.hint
    store.install(S2, source="b")
    with pytest.raises(PrimaryKeyRemoval) as info:
        store.remove(key_id(S1))
    assert f"mlxctl secret use {key_id(S2).hex()}" in info.value.hint
    store.set_primary(key_id(S2))
    store.remove(key_id(S1))
    assert not (store.dir / f"{key_id(S1).hex()}.key").exists()
    assert [k.key_id for k in store.list()] == [key_id(S2).hex()]
    assert key_id(S1) not in store.keyring


def test_unknown_and_malformed_key_ids_are_named(store: KeyStore) -> None:
    with pytest.raises(UnknownKey, match="00112233445566ff"):
        store.set_primary(bytes.fromhex("00112233445566ff"))
    with pytest.raises(UnknownKey, match="00112233445566ff"):
        store.remove(bytes.fromhex("00112233445566ff"))
    for bad in ("xyz", "0011", ""):
        with pytest.raises(KeyringError, match="is not a key id"):
            parse_key_id(bad)
    assert parse_key_id(key_id(S1).hex().upper()) == key_id(S1)


def test_short_secrets_are_refused_without_echoing_them(store: KeyStore) -> None:
    with pytest.raises(KeyringError) as info:
        store.install(b"short-secret", source="test")
    assert "short-secret" not in str(info.value) and "16 bytes" in str(info.value)


def test_reopening_loads_the_keyring(db: sqlite_utils.Database, tmp_path: Path) -> None:
    first = KeyStore(db, tmp_path / "keys")
    first.install(S1, source="a")
    first.install(S2, source="b", primary=True)
    again = KeyStore(db, tmp_path / "keys")
    assert again.keyring.primary == S2 and again.keyring.get(key_id(S1)) == S1


def test_a_missing_secondary_file_is_forgotten_a_missing_primary_is_an_error(
    db: sqlite_utils.Database, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = KeyStore(db, tmp_path / "keys")
    store.install(S1, source="a")
    store.install(S2, source="b")
    (store.dir / f"{key_id(S2).hex()}.key").unlink()
    with caplog.at_level(logging.WARNING):
        again = KeyStore(db, tmp_path / "keys")
    assert key_id(S2).hex() in caplog.text
    assert [k.key_id for k in again.list()] == [key_id(S1).hex()]
    (store.dir / f"{key_id(S1).hex()}.key").unlink()
    with pytest.raises(StateError, match=f"primary cluster secret {key_id(S1).hex()}"):
        KeyStore(db, tmp_path / "keys")


def test_a_tampered_file_is_refused(db: sqlite_utils.Database, tmp_path: Path) -> None:
    store = KeyStore(db, tmp_path / "keys")
    store.install(S1, source="a")
    (store.dir / f"{key_id(S1).hex()}.key").write_bytes(S2)
    with pytest.raises(StateError, match="does not hold the secret"):
        KeyStore(db, tmp_path / "keys")


def test_the_database_never_holds_the_secret(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    db = open_db(tmp_path / "state.db")
    with caplog.at_level(logging.DEBUG):
        store = KeyStore(db, tmp_path / "keys")
        for s in (S1, S2, S3):
            store.install(s, source="test")
        store.set_primary(key_id(S2))
        store.remove(key_id(S1))
    db.conn.close()
    blobs = b"".join(p.read_bytes() for p in tmp_path.glob("state.db*"))
    assert key_id(S2).hex().encode() in blobs  # the key ids are there...
    for s in (S1, S2, S3):  # ...the secrets are not, raw or hex
        assert s not in blobs and s.hex().encode() not in blobs
        assert s.hex() not in caplog.text and repr(s) not in caplog.text


def test_a_removed_key_is_retired_until_installed_again(db: sqlite_utils.Database,
                                                        store: KeyStore,
                                                        tmp_path: Path) -> None:
    old, new = b"o" * 32, b"n" * 32
    store.install(old, source="test")
    store.install(new, source="test", primary=True)
    assert store.retired_at(key_id(old)) is None
    store.remove(key_id(old))
    assert store.retired_at(key_id(old)) is not None
    assert KeyStore(db, tmp_path / "keys").retired_at(key_id(old)) is not None  # persisted
    store.install(old, source="mlxctl secret install")  # the operator wants it back
    assert store.retired_at(key_id(old)) is None
    for i in range(MAX_RETIRED + 3):  # bounded: the latest are kept
        secret = f"{i:032d}".encode()
        store.install(secret, source="test")
        store.remove(key_id(secret))
    assert store.retired_at(key_id(b"0" * 32)) is None
    assert store.retired_at(key_id(f"{MAX_RETIRED + 2:032d}".encode())) is not None
