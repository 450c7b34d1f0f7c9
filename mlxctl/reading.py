"""The commands that only read the daemon: ``status``, ``workers``, ``logs``.

One body each, run by the typer commands (``mlxctl.app``) and by the fast path
(``mlxctl.fastpath``) alike; they use the blocking client, and nothing here imports
typer or asyncio.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxceld.control.clients.blocking import BlockingClient
from mlxctl import render
from mlxctl.edge import call_blocking, echo, emit


def status(path: Path, as_json: bool) -> None:
    body = call_blocking(path, as_json, lambda c: c.status())
    emit(as_json, "status", body, lambda: render.status(body))


def workers(path: Path, as_json: bool) -> None:
    body = call_blocking(path, as_json, lambda c: c.workers())
    emit(as_json, "workers", body, lambda: "\n".join(
        [render.workers_table(body["workers"]), *render.worker_groups(body["workers"])]))


def logs(path: Path, worker: str, lines: int, follow: bool, as_json: bool) -> None:
    def job(c: BlockingClient) -> None:
        for chunk in c.logs(worker, lines, follow):
            if as_json:
                echo(json.dumps({"schema": "mlxctl.log/1", "worker": worker, **chunk}))
            else:
                sys.stdout.write(chunk["data"])
                sys.stdout.flush()

    call_blocking(path, as_json, job)
