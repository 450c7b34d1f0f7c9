"""Cluster TOML files written for the tests that read them."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_cluster_toml(tmp_path: Path, model: Path | None,
                       splits: list[tuple[int, int]]) -> Path:
    """``tmp_path/cluster.toml``: a coordinator ``coord`` on 127.0.0.1:19000 and a stage
    ``s{rank}`` on 127.0.0.{2 + rank}:1910{rank} per ``(start, end)`` layer split."""
    text = "[cluster]\nname = \"c\"\n" + f"pipeline_parallel_size = {len(splits)}\n"
    if model is not None:
        text += f'model = "{model}"\n'
    text += textwrap.dedent("""
        [[nodes]]
        id = "coord"
        address = "127.0.0.1:19000"
        role = "coordinator"
        """)
    for rank, (start, end) in enumerate(splits):
        text += textwrap.dedent(f"""
            [[nodes]]
            id = "s{rank}"
            address = "127.0.0.{2 + rank}:1910{rank}"
            role = "pipeline_stage"
            rank = {rank}
            layers = [{start}, {end}]
            """)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path
