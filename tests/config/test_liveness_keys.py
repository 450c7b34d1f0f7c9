"""The failure detector's [daemon] keys: defaults, values, and refusals that say what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.config.liveness import LivenessConfig
from mlxceld.errors import ConfigError


def config(tmp_path: Path, **daemon: Any) -> LivenessConfig:
    data = {"daemon": {"state_dir": str(tmp_path / "s"), **daemon}}
    return build_config(data, tmp_path / "mlxceld.toml", Overrides()).liveness


def test_defaults_and_values(tmp_path: Path) -> None:
    assert config(tmp_path) == LivenessConfig(1.0, 3.0, 10.0)
    assert config(tmp_path, peer_ping_interval_s=0.25, peer_suspect_after_s=1,
                  peer_dead_after_s=2.5) == LivenessConfig(0.25, 1.0, 2.5)


@pytest.mark.parametrize(("keys", "says"), [
    ({"peer_ping_interval_s": 0}, "'daemon.peer_ping_interval_s' must be a number of seconds"),
    ({"peer_suspect_after_s": True}, "'daemon.peer_suspect_after_s' must be"),
    ({"peer_dead_after_s": "10"}, "'daemon.peer_dead_after_s' must be"),
    ({"peer_dead_after_s": 7200}, "in (0, 3600]"),
    ({"peer_dead_after_s": float("nan")}, "'daemon.peer_dead_after_s' must be"),
    ({"peer_suspect_after_s": 0.5}, "peer_ping_interval_s' (1) < 'daemon.peer_suspect_after_s' "
     "(0.5)"),
    ({"peer_suspect_after_s": 12}, "< 'daemon.peer_dead_after_s' (10)"),
])
def test_refused_naming_the_key(tmp_path: Path, keys: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(tmp_path, **keys)
    assert says in err.value.message and err.value.hint
