"""``[daemon] compute_units``: absent or 0 measures them at start, a number above 0 is
declared; anything else is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.errors import ConfigError


def test_absent_or_zero_measures_and_a_number_is_declared(tmp_path: Path) -> None:
    where = tmp_path / "m.toml"
    assert build_config({}, where, Overrides()).compute_units is None
    assert build_config({"daemon": {"compute_units": 0}}, where,
                        Overrides()).compute_units is None
    assert build_config({"daemon": {"compute_units": 120}}, where,
                        Overrides()).compute_units == 120.0
    assert build_config({"daemon": {"compute_units": 0.5}}, where,
                        Overrides()).compute_units == 0.5


@pytest.mark.parametrize("bad", [-1, -0.5, True, "100", float("nan"), float("inf"), [1]])
def test_a_bad_value_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"'daemon\.compute_units' must be a number of at "
                                          r"least 0, not ") as err:
        build_config({"daemon": {"compute_units": bad}}, tmp_path / "m.toml", Overrides())
    assert "0 measures" in err.value.hint
