"""The keyring service: mlxctl secret's install, use and remove with their events, the call
after every install, adopting a configured secret at start, and failing closed."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import sqlite_utils

from mlxceld.cluster.clusterfile.load import load_cluster, select_node
from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.cluster.keyring import KeyringService
from mlxceld.config.daemon import Config, Overrides, build_config
from mlxceld.config.secrets import ENV_FILE, ENV_VALUE
from mlxceld.errors import ConfigError, KeyringError, PrimaryKeyRemoval, UnknownKey
from mlxceld.state import EventLog, KeyStore
from mlxceld.wire.secret import key_id

S1 = b"first-cluster-secret-0123456789"
S2 = b"second-cluster-secret-abcdefghij"


@pytest.fixture(autouse=True)
def no_secret_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.delenv(ENV_VALUE, raising=False)


class Service:
    """A ``KeyringService`` on the real database, counting its ``on_install`` calls."""

    def __init__(self, db: sqlite_utils.Database, keys_dir: Path) -> None:
        self.events = EventLog(db)
        self.installs = 0
        self.keys = KeyringService(KeyStore(db, keys_dir), self.events,
                                   on_install=self.installed)

    def installed(self) -> None:
        self.installs += 1

    def kinds(self) -> list[tuple[str, str, str | None]]:
        return [(e.kind, e.subject, e.data.get("key_id"))
                for e in self.events.since(0, 100, "keyring")]


@pytest.fixture
def svc(db: sqlite_utils.Database, tmp_path: Path) -> Service:
    return Service(db, tmp_path / "keys")


def config(tmp_path: Path, cluster_secret_file: Path | None = None) -> Config:
    return build_config({"daemon": {"state_dir": str(tmp_path)}}, tmp_path / "mlxceld.toml",
                        Overrides(cluster_secret_file=cluster_secret_file))


def placement(tmp_path: Path, stages: int, secret_file: str | None = None) -> Placement:
    text = "[cluster]\nname = \"c\"\n" + f"pipeline_parallel_size = {stages}\n"
    text += 'model = "model"\n'
    if secret_file is not None:
        text += f'secret_file = "{secret_file}"\n'
    text += '[[nodes]]\nid = "coord"\naddress = "127.0.0.1:19000"\nrole = "coordinator"\n'
    for rank in range(stages):
        text += textwrap.dedent(f"""
            [[nodes]]
            id = "s{rank}"
            address = "127.0.0.1:1910{rank}"
            role = "pipeline_stage"
            rank = {rank}
            layers = [{rank}, {rank + 1}]
            """)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    cluster = load_cluster(path)
    return Placement(cluster, select_node(cluster, "coord"), tmp_path / "model", "id")


def test_install_use_remove_each_with_its_event(svc: Service) -> None:
    k1, k2 = key_id(S1).hex(), key_id(S2).hex()
    first = svc.keys.install(S1, False, "test")
    assert (first.key_id, first.state, first.source) == (k1, "primary", "test")
    assert svc.keys.install(S2, False, "test").state == "installed"
    assert svc.keys.use(k2).state == "primary"
    assert svc.keys.keyring.primary_id == key_id(S2)
    assert svc.keys.remove(k1).key_id == k1
    assert [k.key_id for k in svc.keys.list()] == [k2]
    assert svc.kinds() == [("secret.installed", "keyring", k1),
                           ("secret.installed", "keyring", k2),
                           ("secret.primary", "keyring", k2),
                           ("secret.removed", "keyring", k1)]


def test_on_install_is_called_after_every_install_and_its_event(
        db: sqlite_utils.Database, tmp_path: Path) -> None:
    seen: list[int] = []
    events = EventLog(db)

    def installed() -> None:  # the daemon starts its agent listener here on the first
        seen.append(len(events.since(0, 100, "keyring")))

    keys = KeyringService(KeyStore(db, tmp_path / "keys"), events, on_install=installed)
    keys.install(S1, False, "test")
    keys.install(S2, True, "test")
    keys.use(key_id(S1).hex())
    assert seen == [1, 2]


def test_refusals_change_nothing(svc: Service) -> None:
    svc.keys.install(S1, False, "test")
    with pytest.raises(PrimaryKeyRemoval):
        svc.keys.remove(key_id(S1).hex())
    with pytest.raises(UnknownKey):
        svc.keys.use(key_id(S2).hex())
    with pytest.raises(KeyringError, match="is not a key id"):
        svc.keys.remove("nope")
    with pytest.raises(KeyringError, match="unusable"):
        svc.keys.install(b"short", False, "test")
    assert [k.key_id for k in svc.keys.list()] == [key_id(S1).hex()]
    assert [kind for kind, _, _ in svc.kinds()] == ["secret.installed"]
    assert svc.installs == 1


def test_a_configured_secret_is_adopted_as_the_primary_and_kept(
        svc: Service, db: sqlite_utils.Database, tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(S2 + b"\n")
    secret_file.chmod(0o600)
    svc.keys.install(S1, False, "test")
    svc.keys.adopt(config(tmp_path, cluster_secret_file=secret_file), None)
    assert svc.keys.keyring.primary_id == key_id(S2)
    assert svc.kinds()[-1] == ("secret.adopted", "keyring", key_id(S2).hex())
    assert svc.installs == 1  # adopting is not mlxctl secret install
    again = Service(db, tmp_path / "keys")  # a restart without the flag keeps it
    again.keys.adopt(config(tmp_path), None)
    assert again.keys.keyring.primary_id == key_id(S2)
    assert [kind for kind, _, _ in again.kinds()].count("secret.adopted") == 1


def test_the_secret_variable_is_adopted_and_dropped(svc: Service, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VALUE, S1.decode())
    svc.keys.adopt(config(tmp_path), None)
    assert ENV_VALUE not in os.environ
    assert svc.keys.keyring.primary_id == key_id(S1)


def test_a_cluster_tomls_secret_file_is_adopted(svc: Service, tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(S1)
    (tmp_path / "secret").chmod(0o600)
    svc.keys.adopt(config(tmp_path), placement(tmp_path, 2, secret_file="secret"))
    assert svc.keys.keyring.primary_id == key_id(S1)


def test_no_secret_anywhere_adopts_nothing(svc: Service, tmp_path: Path) -> None:
    svc.keys.adopt(config(tmp_path), None)
    assert not len(svc.keys.keyring) and svc.kinds() == []


def test_fails_closed_without_a_secret(svc: Service, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--pp-auto needs the cluster secret"):
        svc.keys.require(pp_auto=True, placement=None)
    with pytest.raises(ConfigError, match="has 2 stages and needs the cluster secret"):
        svc.keys.require(pp_auto=False, placement=placement(tmp_path, 2))
    svc.keys.require(pp_auto=False, placement=None)
    svc.keys.require(pp_auto=False, placement=placement(tmp_path, 1))  # one host, one stage
    with pytest.raises(ConfigError) as err:
        svc.keys.require(pp_auto=False, placement=None, router=True)
    assert err.value.message.startswith("--node-role router needs the cluster secret")
    for source in ("--cluster-secret-file", "MLXCEL_CLUSTER_SECRET_FILE",
                   "MLXCEL_CLUSTER_SECRET,", "[daemon] cluster_secret_file",
                   f"the keyring in {svc.keys.dir}"):
        assert source in err.value.message, source
    svc.keys.install(S1, False, "test")
    svc.keys.require(pp_auto=False, placement=None, router=True)
    svc.keys.require(pp_auto=True, placement=None)
    svc.keys.require(pp_auto=False, placement=placement(tmp_path, 2))
