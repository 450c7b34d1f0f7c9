"""--cluster-name, --cluster-peers and --cluster-discovery, and their [daemon] keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.config.daemon import Config, Overrides, build_config
from mlxceld.config.peers import parse_peers
from mlxceld.errors import ConfigError


def config(tmp_path: Path, daemon: dict[str, object] | None = None, **flags: str) -> Config:
    data = {"daemon": {"state_dir": str(tmp_path), **(daemon or {})}}
    return build_config(data, tmp_path / "mlxceld.toml", Overrides(**flags))


def test_defaults(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert (cfg.cluster_name, cfg.cluster_peers, cfg.cluster_discovery) == (
        "mlxcel-cluster", (), "static")


def test_flags_win_over_keys(tmp_path: Path) -> None:
    keys = {"cluster_name": "lab", "cluster_peers": ["10.0.0.1:19000"],
            "cluster_discovery": "static"}
    assert config(tmp_path, keys).cluster_peers == ("10.0.0.1:19000",)
    cfg = config(tmp_path, keys, cluster_name="prod", cluster_peers="10.0.0.2:1, 10.0.0.3:2",
                 cluster_discovery="mdns")
    assert cfg.cluster_name == "prod"
    assert cfg.cluster_peers == ("10.0.0.2:1", "10.0.0.3:2")
    assert cfg.cluster_discovery == "mdns"
    assert config(tmp_path, keys, cluster_peers="").cluster_peers == ()


def test_duplicates_dropped_keeping_the_first() -> None:
    assert parse_peers("10.0.0.1:1,[::ffff:10.0.0.1]:1,b:2", "--cluster-peers") == (
        "10.0.0.1:1", "b:2")


@pytest.mark.parametrize(("value", "words"), [
    ("10.0.0.1", "'10.0.0.1' has no ':port'"),
    ("10.0.0.1:0", "outside 1-65535"),
    ("fd00::1:19000", "IPv6 address in brackets"),
    ("[nope]:1", "not an IPv6 address"),
    ("a:1,,b:2", "an empty entry"),
    ("under_score:1", "neither an IP address nor a hostname"),
])
def test_bad_peers_name_the_flag_and_value(tmp_path: Path, value: str, words: str) -> None:
    with pytest.raises(ConfigError, match="--cluster-peers") as err:
        config(tmp_path, cluster_peers=value)
    assert words in err.value.message
    assert "host:port" in err.value.hint


def test_bad_keys_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'daemon\.cluster_peers' must be a list"):
        config(tmp_path, {"cluster_peers": "10.0.0.1:1"})
    with pytest.raises(ConfigError, match=r"'daemon\.cluster_peers': peer 'x'"):
        config(tmp_path, {"cluster_peers": ["x"]})
    with pytest.raises(ConfigError, match=r"'daemon\.cluster_discovery': discovery 'dns'"):
        config(tmp_path, {"cluster_discovery": "dns"})
    with pytest.raises(ConfigError, match=r"'daemon\.cluster_name': cluster name 7"):
        config(tmp_path, {"cluster_name": 7})


@pytest.mark.parametrize(("name", "words"), [
    ("", "must not be empty"),
    ("x" * 129, "129 characters long"),
    ("a\tb", "control character U+0009"),
    ("é" * 121, "242 bytes of UTF-8"),
    ("\udcff", "not valid Unicode"),
])
def test_bad_cluster_names(tmp_path: Path, name: str, words: str) -> None:
    with pytest.raises(ConfigError, match="--cluster-name") as err:
        config(tmp_path, cluster_name=name)
    assert words in err.value.message


def test_bad_discovery_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--cluster-discovery: discovery 'avahi' is not one "
                       "of static, mdns"):
        config(tmp_path, cluster_discovery="avahi")
