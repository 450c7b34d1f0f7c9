"""The 2D mesh prompt-cache benchmark kept from rotting: its ``--quick`` run (the tiny
llama fixture, 3 turns) chats over the mesh with the cache off and on and over the plain
pipeline, prints the table and the ratios, the mesh's answers the same either way and its
stages' hits counted, and leaves no process behind. It asserts the outcome, not the speed
(bench/mesh_cache.py prints that)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_quick_run_times_each_turn_with_and_without_the_cache() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "mesh_cache.py"), "--quick"],
                          capture_output=True, text=True, timeout=280, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    out = done.stdout
    assert done.returncode == 0, (out, done.stderr[-3000:])
    assert "mesh 2x2, cache on: {'hits': 2, 'misses': 1" in out, out
    assert "mesh 2x2, cache off: {'hits': 0" in out, out
    rows = [line for line in out.splitlines() if line.startswith(("mesh 2x2, cache o",
                                                                  "2 stages, cache on"))
            and "{" not in line]
    assert len(rows) == 3 and all(len(r[22:].split()) == 3 for r in rows), rows
    assert "mesh growth / 2 stages' growth: " in out
    assert "the mesh's answers the same with the cache and without: True" in out
