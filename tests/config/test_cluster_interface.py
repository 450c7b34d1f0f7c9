"""``[daemon] cluster_interface``: an interface's name, for an agent on every interface;
anything else is refused by name (the key, and the agent address it conflicts with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.errors import ConfigError


def test_absent_is_none_and_a_name_is_taken_for_an_agent_on_every_interface(
        tmp_path: Path) -> None:
    where = tmp_path / "m.toml"
    assert build_config({}, where, Overrides()).cluster_interface is None
    config = build_config({"daemon": {"cluster_interface": "bridge0"}}, where, Overrides())
    assert config.cluster_interface == "bridge0" and config.agent_addr.startswith("0.0.0.0:")
    # not up yet is not an error: a Thunderbolt bridge comes up with its cable
    assert build_config({"daemon": {"cluster_interface": "en9", "agent_addr": "[::]:19000"}},
                        where, Overrides()).cluster_interface == "en9"


@pytest.mark.parametrize("bad", ["", "a b", "eth0/1", "x" * 65, 3, True, ["eth0"]])
def test_a_bad_name_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"'daemon\.cluster_interface' must be a network "
                                          r"interface's name, not ") as err:
        build_config({"daemon": {"cluster_interface": bad}}, tmp_path / "m.toml", Overrides())
    assert "bridge0" in err.value.hint


@pytest.mark.parametrize("agent", ["10.0.0.5:19000", "mac-1.local:19000"])
def test_an_agent_on_one_address_refuses_an_interface_beside_it(tmp_path: Path,
                                                                 agent: str) -> None:
    with pytest.raises(ConfigError, match=r"'daemon\.cluster_interface' \('bridge0'\) chooses "
                                          rf"the address .* the agent address '{agent}' is "
                                          "one address already") as err:
        build_config({"daemon": {"cluster_interface": "bridge0", "agent_addr": agent}},
                     tmp_path / "m.toml", Overrides())
    assert "0.0.0.0:PORT" in err.value.hint
    # the flag's agent address counts as the key's would
    with pytest.raises(ConfigError, match="one address already"):
        build_config({"daemon": {"cluster_interface": "bridge0"}}, tmp_path / "m.toml",
                     Overrides(agent_addr=agent))
