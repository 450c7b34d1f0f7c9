"""The node's cluster secret: precedence, trimming, errors that name every source, warnings."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mlxceld.config.secrets import ENV_FILE, ENV_VALUE, TomlSecretFile, resolve_secret
from mlxceld.errors import ConfigError, SecretSourceError
from mlxceld.wire.secret import Keyring

from helpers.keys import keyring

A = b"secret-from-the-flag-file-000000"
B = b"secret-from-the-env-file-1111111"
C = "secret-from-the-env-value-222222"
D = b"secret-from-the-toml-file-333333"
E = b"secret-in-the-keyring-4444444444"
ALL_SOURCES = ("--cluster-secret-file", ENV_FILE, ENV_VALUE, "[daemon] cluster_secret_file",
               "[cluster] secret_file", "the keyring in")


def write(path: Path, content: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "toml").mkdir()
    return {
        "flag": write(tmp_path / "a.key", A + b"\n"),
        "env": write(tmp_path / "b.key", B + b"\r\n"),
        "toml": write(tmp_path / "toml" / "d.key", D),
        "cluster.toml": tmp_path / "toml" / "cluster.toml",
    }


def test_precedence_flag_env_file_env_value_toml_keyring(files: dict[str, Path]) -> None:
    toml = TomlSecretFile("d.key", files["cluster.toml"])  # relative to the TOML's dir
    env = {ENV_FILE: str(files["env"])}
    got = resolve_secret(flag_file=files["flag"], environ=env, toml=toml, keyring=keyring(E))
    assert got is not None and got.secret == A and str(files["flag"]) in got.source
    got = resolve_secret(environ=env, toml=toml, keyring=keyring(E))
    assert got is not None and got.secret == B and got.source.startswith(ENV_FILE)
    got = resolve_secret(environ={ENV_VALUE: C}, toml=toml, keyring=keyring(E))
    assert got is not None and got.secret == C.encode() and got.source == ENV_VALUE
    got = resolve_secret(environ={}, toml=toml, keyring=keyring(E))
    assert got is not None and got.secret == D and str(files["toml"]) in got.source
    got = resolve_secret(environ={}, keyring=keyring(E))
    assert got is not None and got.secret == E and got.from_keyring
    assert resolve_secret(environ={}, keyring=Keyring()) is None
    assert resolve_secret(environ={}) is None


def test_the_config_files_key_is_below_the_variables_above_the_toml(
        files: dict[str, Path]) -> None:
    toml = TomlSecretFile("d.key", files["cluster.toml"])
    conf = files["flag"]  # [daemon] cluster_secret_file (resolved by mlxceld.config.daemon)
    got = resolve_secret(environ={ENV_FILE: str(files["env"])}, config_file=conf, toml=toml)
    assert got is not None and got.secret == B
    got = resolve_secret(environ={ENV_VALUE: C}, config_file=conf, toml=toml)
    assert got is not None and got.secret == C.encode()
    got = resolve_secret(environ={}, config_file=conf, toml=toml, keyring=keyring(E))
    assert got is not None and got.secret == A
    assert got.source == f"[daemon] cluster_secret_file {conf}"
    with pytest.raises(SecretSourceError) as info:
        resolve_secret(environ={}, config_file=conf.with_name("gone.key"), toml=toml)
    assert "gone.key (from [daemon] cluster_secret_file) cannot be read" in info.value.message


def test_file_content_is_trimmed_once_and_only_at_the_end(tmp_path: Path) -> None:
    cases = {b"x" * 16 + b"\r\n": b"x" * 16, b"x" * 16 + b"\n\n": b"x" * 16 + b"\n",
             b" " + b"x" * 16 + b" \n": b" " + b"x" * 16 + b" ", b"x" * 16 + b"\r": b"x" * 16
             + b"\r"}
    for content, expected in cases.items():
        got = resolve_secret(flag_file=write(tmp_path / "s", content), environ={})
        assert got is not None and got.secret == expected


def test_an_env_value_is_not_trimmed() -> None:
    got = resolve_secret(environ={ENV_VALUE: "y" * 16 + "\n"})
    assert got is not None and got.secret == b"y" * 16 + b"\n"


def test_both_env_vars_set_is_an_error_even_with_the_flag(files: dict[str, Path]) -> None:
    env = {ENV_FILE: str(files["env"]), ENV_VALUE: C}
    with pytest.raises(SecretSourceError) as info:
        resolve_secret(flag_file=files["flag"], environ=env)
    assert ENV_FILE in info.value.message and ENV_VALUE in info.value.message
    assert C not in info.value.message and C not in info.value.hint
    assert isinstance(info.value, ConfigError)  # mlxceld exits 2


@pytest.mark.parametrize("source", ["flag", "env_file", "env_value", "toml"])
def test_a_short_secret_names_every_source_and_the_one_used(tmp_path: Path,
                                                            source: str) -> None:
    short = write(tmp_path / "short.key", b"fifteen-bytes!!\n")
    flag = short if source == "flag" else None
    env = {"env_file": {ENV_FILE: str(short)}, "env_value": {ENV_VALUE: "fifteen-bytes!!"}}
    toml = TomlSecretFile(str(short), tmp_path / "c.toml") if source == "toml" else None
    with pytest.raises(SecretSourceError) as info:
        resolve_secret(flag_file=flag, environ=env.get(source, {}), toml=toml,
                       keyring=keyring(E), keyring_where="/state/keys")
    message = info.value.message
    for name in ALL_SOURCES:
        assert name in message, name
    assert message.count("(used)") == 1
    used = {"flag": "--cluster-secret-file", "env_file": ENV_FILE, "env_value": ENV_VALUE,
            "toml": "[cluster] secret_file"}[source]
    assert f"{used}: " in message.split("(used)")[0].rsplit(";", 1)[-1]
    assert "15 byte(s)" in message and "at least 16" in message
    assert "fifteen-bytes" not in message
    assert "mlxctl secret generate" in info.value.hint


def test_a_missing_file_names_every_source(tmp_path: Path) -> None:
    with pytest.raises(SecretSourceError) as info:
        resolve_secret(flag_file=tmp_path / "nope.key", environ={})
    assert "nope.key" in info.value.message and "cannot be read" in info.value.message
    for name in ALL_SOURCES:
        assert name in info.value.message


def test_an_empty_env_var_counts_as_set() -> None:
    with pytest.raises(SecretSourceError, match="0 byte"):
        resolve_secret(environ={ENV_VALUE: ""})
    with pytest.raises(SecretSourceError, match="set but empty"):
        resolve_secret(environ={ENV_FILE: ""})


def test_a_group_readable_file_draws_a_warning_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "wide.key", A, mode=0o640)
    with caplog.at_level(logging.WARNING, logger="mlxceld.cluster"):
        got = resolve_secret(flag_file=path, environ={})
    assert got is not None and got.secret == A
    assert str(path) in caplog.text and "readable by group or others" in caplog.text
    assert A.decode() not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxceld.cluster"):
        resolve_secret(flag_file=write(tmp_path / "ok.key", A), environ={})
    assert caplog.text == ""
