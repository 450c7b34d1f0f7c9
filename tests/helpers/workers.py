"""A worker process run once as the supervisor runs it: fed its bootstrap, its exit code,
exit record and log read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mlxceld.roles.options import WorkerOptions
from mlxceld.supervisor.exits import read_exit_record
from mlxceld.supervisor.process import WorkerSpec, child_environment

EXIT_TIMEOUT_S = 60.0  # the worker's imports (mlx) on a loaded machine


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
