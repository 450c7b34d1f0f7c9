"""mlx's wired limit in the router and stage workers: mlx-lm's rule, a no-op where the
device recommends no working set (mlx's CPU backend here; a Mac's Metal has one)."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from mlxceld.workers.wired import set_wired_limit


def test_a_device_without_a_recommended_working_set_is_left_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    if "max_recommended_working_set_size" in mx.device_info():
        pytest.skip("this device recommends a working set (Metal): the limit would change")
    with caplog.at_level(logging.INFO, logger="mlxceld.workers.wired"):
        set_wired_limit()
    assert caplog.records == []
