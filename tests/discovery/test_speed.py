"""This daemon's compute units: the measurement (bounded), its cache in the state
database, and a declared value that wins."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from pathlib import Path

import pytest

from mlxceld.discovery.speed import NodeSpeed
from mlxceld.errors import ConfigError
from mlxceld.models.speed import (
    DEFAULT_DTYPE,
    SIZE,
    measure_units,
    model_dtype,
    speed_key,
)
from mlxceld.state import Settings
from mlxceld.state.startup import start_state


def settings(tmp_path: Path) -> Settings:
    return Settings(start_state(tmp_path / "state.db", reset=False).db)


def test_the_measurement_is_bounded_by_its_budget() -> None:
    """A clock that moves 10 ms a reading: products until 50 ms have passed, then the rate
    of what was timed (the real mlx product, in the dtype asked for)."""
    ticks = itertools.count()
    read: list[float] = []

    def clock() -> float:
        read.append(next(ticks) * 0.01)
        return read[-1]

    units = measure_units("float16", 0.05, clock=clock)
    products = len(read) - 1  # one reading to start, one after each product
    assert products == 5
    assert units == pytest.approx(round(products * SIZE * SIZE * 2 / 0.05 / 1e9, 3))


def test_a_real_measurement_and_what_it_refuses() -> None:
    assert measure_units(DEFAULT_DTYPE, 0.01) > 0
    with pytest.raises(ConfigError, match="cannot measure compute units in 'int8'"):
        measure_units("int8", 0.01)


def test_the_dtype_and_the_key(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert model_dtype(str(model)) == "float16"
    (model / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert model_dtype(str(model)) == "float32"
    (model / "config.json").write_text(json.dumps({"torch_dtype": "int4"}))
    assert model_dtype(str(model)) == DEFAULT_DTYPE
    assert model_dtype(None) == model_dtype(str(tmp_path / "nope")) == DEFAULT_DTYPE
    assert speed_key("float16") != speed_key("bfloat16")
    assert speed_key("float16").endswith("/float16") and "compute_units/" in speed_key("x")


def test_measured_once_then_cached_across_restarts(tmp_path: Path) -> None:
    calls: list[str] = []

    def measure(dtype: str) -> float:
        calls.append(dtype)
        return 12.5

    first = NodeSpeed(settings(tmp_path), declared=lambda: None, model=lambda: None,
                      measure=measure)
    assert first.units() is None and first.describe()["source"] == "unmeasured"
    asyncio.run(first.measure())
    assert calls == [DEFAULT_DTYPE] and first.units() == 12.5
    assert first.describe() == {"units": 12.5, "source": "measured", "dtype": DEFAULT_DTYPE,
                                "error": None}
    again = NodeSpeed(settings(tmp_path), declared=lambda: None, model=lambda: None,
                      measure=measure)  # the next start, the same database
    asyncio.run(again.measure())
    assert calls == [DEFAULT_DTYPE] and again.units() == 12.5


def test_a_declared_value_wins_and_is_never_measured(tmp_path: Path) -> None:
    calls: list[str] = []
    declared: list[float | None] = [40.0]

    def measure(dtype: str) -> float:
        calls.append(dtype)
        return 3.0

    speed = NodeSpeed(settings(tmp_path), declared=lambda: declared[0], model=lambda: None,
                      measure=measure)
    asyncio.run(speed.measure())
    assert calls == [] and speed.units() == 40.0
    assert speed.describe()["source"] == "declared"
    declared[0] = None  # a reload that drops the key: measured at the next start
    assert speed.units() is None


def test_a_measurement_past_its_deadline_is_abandoned(tmp_path: Path) -> None:
    """The wait ends at the deadline (the thread is let go, and ends once released); the
    units stay unknown and the status says why."""
    release = threading.Event()

    def stuck(dtype: str) -> float:
        release.wait(30)
        return 1.0

    speed = NodeSpeed(settings(tmp_path), declared=lambda: None, model=lambda: None,
                      measure=stuck, deadline_s=0.05)

    async def main() -> None:
        try:
            await speed.measure()
        finally:
            release.set()  # before asyncio.run waits for its threads

    asyncio.run(main())
    shown = speed.describe()
    assert speed.units() is None and shown["source"] == "unmeasured"
    assert "took more than 0.05 s" in str(shown["error"])


def test_a_failed_measurement_is_shown_and_not_cached(tmp_path: Path) -> None:
    def broken(dtype: str) -> float:
        raise ConfigError("cannot measure compute units in bfloat16: no device")

    speed = NodeSpeed(settings(tmp_path), declared=lambda: None, model=lambda: None,
                      measure=broken)
    asyncio.run(speed.measure())
    assert speed.units() is None
    assert speed.describe()["error"] == "cannot measure compute units in bfloat16: no device"


def test_another_dtype_is_another_measurement(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    served: list[str | None] = [None]
    speed = NodeSpeed(settings(tmp_path), declared=lambda: None, model=lambda: served[0],
                      measure=lambda dtype: {"bfloat16": 2.0, "float16": 3.0}[dtype])
    asyncio.run(speed.measure())
    assert speed.units() == 2.0
    served[0] = str(model)
    assert speed.units() is None  # not measured in float16 yet
    asyncio.run(speed.measure())
    assert speed.units() == 3.0
