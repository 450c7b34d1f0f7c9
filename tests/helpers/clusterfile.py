"""Cluster TOML files written for the tests that read them."""

from __future__ import annotations

from pathlib import Path

from mlxceld.cluster.clusterfile.load import dump_cluster
from mlxceld.cluster.clusterfile.model import StageEntry, pipeline_cluster


def write_cluster_toml(tmp_path: Path, model: Path | None,
                       splits: list[tuple[int, int]]) -> Path:
    """``tmp_path/cluster.toml``: a coordinator ``coord`` on 127.0.0.1:19000 and a stage
    ``s{rank}`` on 127.0.0.{2 + rank}:1910{rank} per ``(start, end)`` layer split."""
    path = tmp_path / "cluster.toml"
    stages = [StageEntry(f"s{rank}", f"127.0.0.{2 + rank}:1910{rank}", layers)
              for rank, layers in enumerate(splits)]
    path.write_text(dump_cluster(pipeline_cluster("c", model, ("coord", "127.0.0.1:19000"),
                                                  stages, path=path)))
    return path
