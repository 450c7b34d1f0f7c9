"""A loading peer's word in its ``preparing`` heartbeat (``push.peer_load``), and how
``mlxctl cluster activate`` prints it (``render.peer_loading``)."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.cluster.assignment.coordinator_round import PeerLoad
from mlxceld.cluster.assignment.push import peer_load as load_of
from mlxceld.wire.assignment_messages import Preparing
from mlxctl import render


def peer_load(header: dict[str, Any]) -> PeerLoad | None:
    """The load of a ``preparing`` heartbeat carrying ``header``'s fields."""
    return load_of(Preparing.from_wire({"t": "preparing", "epoch": 1, **header}))


def test_a_heartbeat_with_a_load() -> None:
    assert peer_load({"done": 5, "total": 10, "elapsed_s": 2}) == PeerLoad(5, 10, 2.0)
    assert peer_load({}) is None  # a peer that says nothing (yet, or an older version)
    assert peer_load({"done": 5, "total": 10, "elapsed_s": 2, "step": "downloading"}) == \
        PeerLoad(5, 10, 2.0, "downloading")
    assert peer_load({"done": 5, "total": 10, "elapsed_s": 2, "step": 3}).step == "loading"


@pytest.mark.parametrize("header", [
    {"done": 11, "total": 10, "elapsed_s": 1.0}, {"done": -1, "total": 10, "elapsed_s": 1.0},
    {"done": True, "total": 10, "elapsed_s": 1.0}, {"done": 1, "total": "10", "elapsed_s": 1},
    {"done": 1, "total": 10, "elapsed_s": -3}, {"done": 1, "total": 10},
    {"done": 1.5, "total": 10, "elapsed_s": 1}])
def test_a_load_that_does_not_add_up_is_ignored(header: dict[str, Any]) -> None:
    assert peer_load(header) is None


def test_activate_prints_a_loading_peer() -> None:
    row = {"stage": "stage-1", "address": "127.0.0.2:7000", "layers": [2, 4],
           "state": "loading", "loading": {"done": 3 << 30, "total": 12 << 30,
                                           "elapsed_s": 12.3}}
    pct, line = render.peer_loading(row) or (None, "")
    assert pct == 25
    assert line.split() == ["stage-1", "127.0.0.2:7000", "layers", "[2,", "4)", "loading",
                            "25%", "of", "12.0", "GiB,", "12", "s"]
    assert render.peer_loading({**row, "loading": None}) is None
    assert render.peer_loading({**row, "state": "prepared"}) is None
    assert render.peer_loading({**row, "loading": {"done": "x"}}) is None
