"""The security log limiter, with time driven by the test: 5 per minute per class."""

from __future__ import annotations

import logging

import pytest

from mlxceld.net import SecurityClass, SecurityLog


def test_five_per_minute_then_suppressed_then_a_summary() -> None:
    limiter = SecurityLog()
    assert [limiter.admit("noise", t, "junk").warn for t in range(5)] == [True] * 5
    assert not limiter.admit("noise", 5.0, "junk").warn
    assert not limiter.admit("noise", 6.0, "pool refusal").warn
    assert not limiter.admit("noise", 59.9, "junk").warn  # the first is 59.9 s old: still full
    verdict = limiter.admit("noise", 60.0, "junk")  # the first one left the window
    assert verdict.warn and verdict.suppressed == 3
    assert verdict.summary == ("3 more noise warning(s) suppressed in the last 55 s "
                               "(2 x junk, 1 x pool refusal)")
    assert limiter.admit("noise", 61.0).warn and limiter.admit("noise", 61.0).summary == ""


def test_classes_are_limited_separately() -> None:
    limiter = SecurityLog()
    for t in range(5):
        limiter.admit("noise", float(t))
    assert not limiter.admit("noise", 10.0).warn
    others: tuple[SecurityClass, ...] = ("diagnostic", "capacity", "router_drop")
    for cls in others:
        assert all(limiter.admit(cls, 10.0).warn for _ in range(5))
        assert not limiter.admit(cls, 10.0).warn


def test_the_window_slides() -> None:
    limiter = SecurityLog(per_window=2, window_s=10.0)
    assert limiter.admit("diagnostic", 0.0).warn
    assert limiter.admit("diagnostic", 5.0).warn
    assert not limiter.admit("diagnostic", 9.0).warn
    assert limiter.admit("diagnostic", 10.0).warn  # t=0 expired
    assert not limiter.admit("diagnostic", 14.0).warn  # t=5 and t=10 still in
    assert limiter.admit("diagnostic", 15.0).warn


def test_warn_writes_five_then_counts_then_the_summary(
    caplog: pytest.LogCaptureFixture
) -> None:
    limiter = SecurityLog()
    with caplog.at_level(logging.DEBUG, logger="mlxceld.net.securitylog"):
        for i in range(7):
            limiter.warn("diagnostic", "auth failure from %s", f"10.0.0.{i}", now=float(i))
        limiter.warn("diagnostic", "auth failure from %s", "10.0.0.99", now=100.0)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING] * 6  # the two suppressed: not a line, not even debug
    assert caplog.records[0].getMessage() == "[diagnostic] auth failure from 10.0.0.0"
    last = caplog.records[-1].getMessage()
    assert last.startswith("[diagnostic] auth failure from 10.0.0.99; 2 more diagnostic")
    assert "(2 x auth failure from %s)" in last


def test_a_flood_is_a_few_lines_and_flush_reports_its_counts(
    caplog: pytest.LogCaptureFixture
) -> None:
    limiter = SecurityLog()
    with caplog.at_level(logging.DEBUG, logger="mlxceld.net.securitylog"):
        for i in range(100_000):
            kind = "evicted" if i % 4 else "hello_timeout"
            limiter.warn("noise", "refused %s (%s)", f"10.0.0.{i % 250}", kind, now=i / 10_000,
                         kind=kind)
        limiter.flush("agent listener: ", now=10.0)
        limiter.flush("agent listener: ", now=11.0)  # nothing more to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6
    assert lines[-1] == ("[noise] agent listener: 99995 more noise warning(s) suppressed in "
                         "the last 10 s (74997 x evicted, 24998 x hello_timeout)")
