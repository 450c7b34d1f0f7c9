"""A tensor-parallel rank (a router's, a stage's) and the router as rank 0 refuse what
cannot run, before any ring: exit 2 (``EXIT_CONFIG``: not restarted) with an exit record
naming the reason. Real worker processes, fed their bootstrap as the supervisor does."""

from __future__ import annotations

from pathlib import Path

from mlxceld.models import preset, write_fixture
from mlxceld.roles.options import (
    EXIT_CONFIG,
    PipelineOptions,
    PipelineStage,
    RouterOptions,
    StageTensorOptions,
    TensorOptions,
)

from helpers.workers import run_worker

RING = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")  # never dialled: refused before


def test_a_rank_refuses_a_tp_size_that_does_not_divide_the_heads(state_dir: Path,
                                                                tmp_path: Path) -> None:
    model = write_fixture(tmp_path / "llama", preset("tiny", family="llama"))  # 4 heads, 2 KV
    code, summary, log = run_worker(state_dir, "tp-1", TensorOptions(
        model=str(model), model_name="llama", rank=1, tp_hosts=RING, max_batch=4))
    assert code == EXIT_CONFIG, log
    assert summary.startswith("tensor parallelism over 3 ranks refused:"), summary
    assert str(model) in summary and "tp_size" in summary
    assert "joined the ring" not in log


def test_the_router_refuses_tp_over_a_pipeline_naming_the_option(state_dir: Path) -> None:
    pipe = PipelineOptions(stages=(PipelineStage("s0", "127.0.0.1:9", 0, (0, 2)),),
                           coordinator="127.0.0.1:8", model_identity="ab" * 32, cluster="c")
    code, summary, log = run_worker(state_dir, "router", RouterOptions(
        model="/nonexistent", model_name="m", host="127.0.0.1", port=1, max_batch=1,
        max_queued=1, pipeline=pipe, tp_size=2, tp_hosts=RING[:2]))
    assert code == EXIT_CONFIG, log
    assert "tensor parallelism (tp_size 2) is not built for a pipeline stage's router" in summary
    assert "options.pipeline must be null" in summary


def test_a_stage_rank_refuses_a_tp_size_that_does_not_divide_the_heads(
        state_dir: Path, tmp_path: Path) -> None:
    model = write_fixture(tmp_path / "llama", preset("tiny", family="llama", layers=4))
    code, summary, log = run_worker(state_dir, "stage-tp-1", StageTensorOptions(
        model=str(model), layers=(2, 4), node_id="stage-1", rank=1, tp_hosts=RING))
    assert code == EXIT_CONFIG, log
    assert summary.startswith("tensor parallelism over 3 ranks refused:"), summary
    assert "joined the ring" not in log
