"""``[daemon] metrics_listen`` (off unless set; host:port, [v6]:port or a host name) and
``[serve] metrics_require_key`` (true unless set false), each refused by name when bad."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.config.serve import router_options
from mlxceld.errors import ConfigError


def test_metrics_are_off_and_need_the_key_by_default(tmp_path: Path) -> None:
    config = build_config({}, tmp_path / "m.toml", Overrides())
    assert config.metrics_listen is None
    assert config.serve.metrics_require_key is True
    off = build_config({"daemon": {"metrics_listen": ""}}, tmp_path / "m.toml", Overrides())
    assert off.metrics_listen is None


@pytest.mark.parametrize(("text", "host", "port"), [
    ("0.0.0.0:9464", "0.0.0.0", 9464), ("[::1]:9464", "::1", 9464),
    ("localhost:9100", "localhost", 9100), ("127.0.0.1:0", "127.0.0.1", 0)])
def test_metrics_listen_takes_an_address_or_a_name(tmp_path: Path, text: str, host: str,
                                                   port: int) -> None:
    listen = build_config({"daemon": {"metrics_listen": text}}, tmp_path / "m.toml",
                          Overrides()).metrics_listen
    assert listen is not None and (listen.host, listen.port) == (host, port)


@pytest.mark.parametrize("bad", [9464, "9464", "host:99999", "a b:1", True])
def test_a_bad_metrics_listen_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"'daemon\.metrics_listen'") as err:
        build_config({"daemon": {"metrics_listen": bad}}, tmp_path / "m.toml", Overrides())
    assert "0.0.0.0:9464" in err.value.hint


def test_metrics_require_key_false_opens_the_routers_metrics(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = build_config({"serve": {"metrics_require_key": False, "model": str(model)}},
                          tmp_path / "m.toml", Overrides())
    assert config.serve.metrics_require_key is False
    assert router_options(config.serve).metrics_open is True
    with pytest.raises(ConfigError, match=r"'serve\.metrics_require_key' must be true or "
                                          "false"):
        build_config({"serve": {"metrics_require_key": "no"}}, tmp_path / "m.toml",
                     Overrides())
