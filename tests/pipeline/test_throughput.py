"""The router's tokens/s: a rate over the last window of samples of a running count,
with time as an input (no sleeping)."""

from __future__ import annotations

import pytest

from mlxceld.pipeline.throughput import Throughput


def test_no_rate_until_two_samples_lie_apart() -> None:
    t = Throughput(10.0)
    assert t.rate() is None
    t.sample(5, 100.0)
    assert t.rate() is None
    t.sample(5, 100.0)
    assert t.rate() is None
    t.sample(5, 101.0)
    assert t.rate() == 0.0


def test_the_rate_is_over_the_last_window_only() -> None:
    t = Throughput(10.0)
    for second in range(0, 31):  # 100 tokens/s for 20 s, then nothing for 10 s
        t.sample(min(second, 20) * 100, float(second))
        if second == 20:
            assert t.rate() == pytest.approx(100.0)
    assert t.rate() == 0.0  # seconds 20..30: the count stood still
    t.sample(2000 + 50, 31.0)  # a burst shows at once, spread over the window
    assert t.rate() == pytest.approx(50 / 10)


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s must be above 0"):
        Throughput(0)
