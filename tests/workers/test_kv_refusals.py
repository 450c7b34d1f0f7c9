"""The router refuses at start a quantized KV cache (``kv_quant``: ``[serve] kv_bits``) that
its model's family cannot keep: exit 2 (``EXIT_CONFIG``: not restarted) with an exit record
naming ``serve.kv_bits``, the family and the reason; as a local engine, as rank 0 of a
tensor-parallel group (before any ring), and over a pipeline (for all its stages, which
it knows the model of). Real worker processes, fed their bootstrap as the supervisor does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxceld.models import preset, write_fixture
from mlxceld.roles.options import (
    EXIT_CONFIG,
    KVQuant,
    PipelineOptions,
    PipelineStage,
    RouterOptions,
)

from helpers.ports import free_port
from helpers.workers import run_worker

RING = ("127.0.0.1:1", "127.0.0.1:2")  # never dialled: refused before


def router(model: Path, **more: Any) -> RouterOptions:
    return RouterOptions(model=str(model), model_name="m", host="127.0.0.1",
                         port=free_port("127.0.0.1"), max_batch=2, max_queued=2,
                         kv_quant=KVQuant(8), **more)


def test_a_local_router_refuses_a_family_whose_cache_cannot_be_quantized(
        state_dir: Path, tmp_path: Path) -> None:
    model = write_fixture(tmp_path / "gemma", preset("tiny", family="gemma3_text",
                                                     head_dim=64))
    code, summary, log = run_worker(state_dir, "router", router(model))
    assert code == EXIT_CONFIG, log
    assert f"serve.kv_bits = 8: {model / 'config.json'}: model family 'gemma3_text' " \
           "cannot keep a quantized KV cache: its sliding-window layers keep a " \
           "RotatingKVCache" in summary, summary


def test_rank_0_refuses_it_before_the_ring(state_dir: Path, tmp_path: Path) -> None:
    model = write_fixture(tmp_path / "ds", preset("tiny", family="deepseek_v3"))
    code, summary, log = run_worker(state_dir, "router", router(model, tp_size=2,
                                                                tp_hosts=RING))
    assert code == EXIT_CONFIG, log
    assert "serve.kv_bits = 8" in summary and "'deepseek_v3'" in summary, summary
    assert "multi-head latent attention" in summary
    assert "joined the ring" not in log


def test_a_pipeline_router_refuses_it_for_its_stages(state_dir: Path, tmp_path: Path) -> None:
    model = write_fixture(tmp_path / "oss", preset("tiny", family="gpt_oss", head_dim=64))
    pipe = PipelineOptions(stages=(PipelineStage("s0", "127.0.0.1:9", 0, (0, 2)),),
                           coordinator="127.0.0.1:8", model_identity="ab" * 32, cluster="c")
    code, summary, log = run_worker(state_dir, "router", router(model, pipeline=pipe))
    assert code == EXIT_CONFIG, log
    assert "serve.kv_bits = 8" in summary and "'gpt_oss'" in summary, summary
    assert "its attention adds sinks" in summary
