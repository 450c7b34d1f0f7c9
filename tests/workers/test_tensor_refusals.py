"""A tensor-parallel rank and the router as rank 0 refuse what cannot run, before any ring:
exit 2 (``EXIT_CONFIG``: not restarted) with an exit record naming the reason. Real worker
processes, fed their bootstrap as the supervisor does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mlxceld.models import preset, write_fixture
from mlxceld.roles.options import (
    EXIT_CONFIG,
    PipelineOptions,
    PipelineStage,
    RouterOptions,
    TensorOptions,
    WorkerOptions,
)
from mlxceld.supervisor.exits import read_exit_record
from mlxceld.supervisor.process import WorkerSpec, child_environment

EXIT_TIMEOUT_S = 60.0  # the worker's imports (mlx) on a loaded machine
RING = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")  # never dialled: refused before


def run_worker(state_dir: Path, name: str, options: WorkerOptions) -> tuple[int, str, str]:
    """Its exit code, its exit record's summary and its log."""
    spec = WorkerSpec(name, state_dir, options)
    for d in (spec.control_socket.parent, spec.log_path.parent):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    with spec.log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlxceld.workers", "--role", spec.role,
                                 "--name", name], stdin=subprocess.PIPE, stdout=log,
                                stderr=log, cwd=state_dir, env=child_environment(),
                                start_new_session=True)
    try:
        proc.communicate(json.dumps(spec.bootstrap()).encode(), timeout=EXIT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    record = read_exit_record(spec.exit_record, proc.pid)
    return (proc.returncode, record.summary if record else "",
            spec.log_path.read_text(errors="replace"))


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
