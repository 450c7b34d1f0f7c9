"""--distributed-config and --node-id (or their [daemon] keys) come together."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.errors import ConfigError


def test_both_or_neither(tmp_path: Path) -> None:
    base = {"daemon": {"state_dir": str(tmp_path)}}
    with pytest.raises(ConfigError, match="--distributed-config needs --node-id"):
        build_config(base, None, Overrides(distributed_config=tmp_path / "c.toml"))
    with pytest.raises(ConfigError, match="--node-id needs --distributed-config"):
        build_config(base, None, Overrides(node_id="stage-0"))
    cfg = build_config({"daemon": {"state_dir": str(tmp_path), "node_id": "s0",
                                   "distributed_config": "c.toml"}},
                       tmp_path / "mlxceld.toml", Overrides())
    assert cfg.distributed_config == tmp_path / "c.toml" and cfg.node_id == "s0"
    flagged = build_config(base, None, Overrides(distributed_config=Path("x.toml"),
                                                 node_id="n"))
    assert flagged.distributed_config == Path("x.toml").absolute()
