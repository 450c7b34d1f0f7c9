"""``[daemon] heal_after_s``: 60 s by default, 0 turns self-healing off, anything else
out of [0, 3600] seconds is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.errors import ConfigError


def test_heal_after_defaults_to_a_minute_and_zero_is_off(tmp_path: Path) -> None:
    where = tmp_path / "m.toml"
    assert build_config({}, where, Overrides()).heal_after_s == 60.0
    assert build_config({"daemon": {"heal_after_s": 0}}, where, Overrides()).heal_after_s == 0
    assert build_config({"daemon": {"heal_after_s": 2.5}}, where,
                        Overrides()).heal_after_s == 2.5


@pytest.mark.parametrize("bad", [-1, 3601, True, "60", float("nan")])
def test_a_bad_heal_after_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"'daemon\.heal_after_s' must be a number of "
                                          r"seconds in \[0, 3600\]") as err:
        build_config({"daemon": {"heal_after_s": bad}}, tmp_path / "m.toml", Overrides())
    assert "heal_after_s = 0" in err.value.hint
