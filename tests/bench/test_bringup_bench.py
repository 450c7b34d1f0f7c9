"""The bring-up benchmark's two-phase path, kept from rotting: a push to 3 in-process peers
(real agent listeners, real Assignee and SQLite, instant stages) must end with every stage
active. It asserts the outcome, not the time (bench/bringup.py prints that)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from helpers.benches import bench_module


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_module("bringup") as module:
        yield module


def test_the_simulated_push_ends_with_every_stage_active(bench: ModuleType,
                                                          tmp_path: Path) -> None:
    r = asyncio.run(bench.simulated_push(3, tmp_path))
    assert r.finished.ok, r.finished.summary
    assert r.finished.summary.endswith("every stage of 3 is active")
    assert r.peer_states == ["active"] * 3 and r.stage_states == ["active"] * 3
    assert r.seconds > 0


def test_the_cluster_toml_it_pushes_is_valid(bench: ModuleType, tmp_path: Path) -> None:
    from mlxceld.cluster.clusterfile.load import parse_cluster_text, validate_layers

    cfg = parse_cluster_text(bench.cluster_toml("127.0.0.1:19000", [("127.0.0.2", 19100),
                                                                     ("127.0.0.3", 19100)]),
                             tmp_path / "c.toml")
    validate_layers(cfg, 2 * bench.LAYERS_PER_STAGE)
    assert [s.layers for s in cfg.stages] == [(0, 2), (2, 4)]
