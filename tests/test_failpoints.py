"""Fail points are read from the environment; an unknown name or a bad wait is named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxceld import failpoints
from mlxceld.errors import ConfigError


def test_names_are_parsed_and_unknown_ones_named() -> None:
    assert failpoints.parse({}) == frozenset()
    env = {failpoints.ENV: " peer-after-accepted, offer-coordinator ,"}
    assert failpoints.parse(env) == {"peer-after-accepted", "offer-coordinator"}
    with pytest.raises(ConfigError, match="MLXCELD_FAILPOINT names unknown fail point"
                                          r"\(s\) no-such-point") as info:
        failpoints.parse({failpoints.ENV: "peer-after-accepted,no-such-point"})
    assert "coordinator-before-decision" in info.value.hint


def test_the_peer_wait_must_be_positive_seconds() -> None:
    assert failpoints.parse_wait({}) is None
    assert failpoints.parse_wait({failpoints.WAIT_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(ConfigError, match=f"MLXCELD_TEST_PEER_WAIT_S={bad!r}"):
            failpoints.parse_wait({failpoints.WAIT_ENV: bad})


def test_the_activate_bound_must_be_positive_seconds() -> None:
    assert failpoints.parse_activate_for({}) is None
    assert failpoints.parse_activate_for({failpoints.ACTIVATE_ENV: " 4 "}) == 4.0
    for bad in ("0", "-1", "soon", "nan", "inf", "1e999"):
        with pytest.raises(ConfigError, match=f"MLXCELD_TEST_ACTIVATE_FOR_S={bad!r} is not "
                                              "a positive number of seconds") as info:
            failpoints.parse_activate_for({failpoints.ACTIVATE_ENV: bad})
        assert "600 s" in info.value.hint


def test_the_follower_stall_must_be_positive_seconds() -> None:
    assert failpoints.parse_follower_stall({}) is None
    assert failpoints.parse_follower_stall({failpoints.STALL_ENV: "2"}) == 2.0
    with pytest.raises(ConfigError, match="MLXCELD_TEST_FOLLOWER_STALL_S='0' is not") as info:
        failpoints.parse_follower_stall({failpoints.STALL_ENV: "0"})
    assert "30 s" in info.value.hint


def test_the_layer_pauses_must_be_positive_seconds() -> None:
    assert failpoints.parse_router_layer({}) is None
    assert failpoints.parse_router_layer({failpoints.ROUTER_LAYER_ENV: "0.5"}) == 0.5
    assert failpoints.parse_stage_layer({failpoints.STAGE_LAYER_ENV: "1"}) == 1.0
    with pytest.raises(ConfigError, match="MLXCELD_TEST_ROUTER_LAYER_S='-1' is not") as info:
        failpoints.parse_router_layer({failpoints.ROUTER_LAYER_ENV: "-1"})
    assert "a router that loads at its disk's pace" in info.value.hint


def test_the_handoff_knobs_must_be_positive_seconds() -> None:
    assert failpoints.parse_expect_delay({}) is None
    assert failpoints.parse_expect_delay({failpoints.EXPECT_DELAY_ENV: "1"}) == 1.0
    assert failpoints.parse_peers_every({failpoints.PEERS_EVERY_ENV: "600"}) == 600.0
    with pytest.raises(ConfigError, match="MLXCELD_TEST_PEERS_EVERY_S='0' is not") as info:
        failpoints.parse_peers_every({failpoints.PEERS_EVERY_ENV: "0"})
    assert "the documented 5 s" in info.value.hint


def test_the_handover_wait_must_be_positive_seconds() -> None:
    assert failpoints.parse_handover({}) is None
    assert failpoints.parse_handover({failpoints.HANDOVER_ENV: "0.5"}) == 0.5
    with pytest.raises(ConfigError, match="MLXCELD_TEST_HANDOVER_S='x' is not") as info:
        failpoints.parse_handover({failpoints.HANDOVER_ENV: "x"})
    assert "the documented 30 s of a rotation's handover" in info.value.hint


def test_the_memory_cap_must_be_positive_bytes() -> None:
    assert failpoints.parse_memory({}) is None
    assert failpoints.parse_memory({failpoints.MEMORY_ENV: " 604000000 "}) == 604_000_000
    for bad in ("0", "-1", "1.5", "600M", "nan"):
        with pytest.raises(ConfigError, match=f"MLXCELD_TEST_MEMORY_AVAILABLE={bad!r} is not "
                                              "a positive number of bytes"):
            failpoints.parse_memory({failpoints.MEMORY_ENV: bad})


def test_the_compute_units_must_be_a_positive_number() -> None:
    assert failpoints.parse_units({}) is None
    assert failpoints.parse_units({failpoints.UNITS_ENV: ""}) is None  # unset: measure
    assert failpoints.parse_units({failpoints.UNITS_ENV: " 2.5 "}) == 2.5
    for bad in ("0", "-1", "fast", "nan", "inf"):
        with pytest.raises(ConfigError, match=f"MLXCELD_TEST_COMPUTE_UNITS={bad!r} is not a "
                                              "positive number of compute units"):
            failpoints.parse_units({failpoints.UNITS_ENV: bad})


def test_a_bad_activate_bound_stops_the_daemon_at_start(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mlxceld", "--state-dir", f"{tmp_path}/s",
         "--socket", f"{tmp_path}/ctl.sock"],
        env={**os.environ, failpoints.ACTIVATE_ENV: "10m"},
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "mlxceld: error: MLXCELD_TEST_ACTIVATE_FOR_S='10m' is not a positive number of " \
           "seconds" in out.stderr


def test_an_unknown_fail_point_stops_the_daemon_at_start(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mlxceld", "--state-dir", f"{tmp_path}/s",
         "--socket", f"{tmp_path}/ctl.sock"],
        env={**os.environ, "MLXCELD_FAILPOINT": "peer-after-acepted"},
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "mlxceld: error: MLXCELD_FAILPOINT names unknown fail point(s) " \
           "peer-after-acepted" in out.stderr
