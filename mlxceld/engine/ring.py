"""Joining an ``mx.distributed`` ring: one rank of a tensor-parallel group.

``MLX_RANK`` and ``MLX_HOSTFILE`` name this rank and a JSON file of every rank's
``host:port``, written 0600 in a private temporary directory and removed once the ring
is joined. mlx's ``init`` waits for every rank without a deadline; here it gets
``RING_DEADLINE_S``, after which the process exits (status 1). Each rank binds its own
``host:port``: 127.0.0.1 inside one host; across hosts (``--tp-peers``) each host's
agent IP, never a wildcard. The ring is not authenticated: it lives only while the
group does (mlxceld(8) PORTS).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, TextIO

import mlx.core as mx

from mlxceld.engine.base import EngineError

RING_DEADLINE_S: Final = 60.0  # join_ring: for every rank to join (they load first)
BACKEND: Final = "ring"  # TCP sockets; Macs could use "jaccl" later


def join_ring(rank: int, hosts: Sequence[str], *, deadline_s: float = RING_DEADLINE_S,
              stream: TextIO | None = None, worker: str = "tp") -> Any:
    """Join the ``mx.distributed`` ring of ``len(hosts)`` ranks as ``rank``; ``hosts``:
    each rank's ``host:port``, rank 0 first.

    mlx's init waits for every rank without a deadline, and holds the GIL while it does
    (no other thread of this process runs). So the deadline is kept by faulthandler's own
    watchdog thread, which needs no GIL: when the others have not all joined within
    ``deadline_s``, it writes every thread's stack and a line naming the ranks to
    ``stream`` (stderr: the worker's log) and ends the process with status 1."""
    if not 0 <= rank < len(hosts) or len(hosts) < 2:
        raise ValueError(f"rank {rank} of {len(hosts)} ranks: a ring needs at least 2 "
                         "ranks and a rank among them")
    out = stream or sys.stderr
    others = ", ".join(f"rank {r} ({h})" for r, h in enumerate(hosts) if r != rank)
    print(f"rank {rank} joins the tensor-parallel ring at {hosts[rank]}; if the other "
          f"ranks ({others}) have not all joined within {deadline_s:g} s, this process "
          "exits with status 1 "
          f"(each rank is a worker of this daemon: mlxctl workers; mlxctl logs {worker}-1)",
          file=out, flush=True)
    with tempfile.TemporaryDirectory(prefix="mlxceld-ring-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        fd = os.open(hostfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump([[h] for h in hosts], f)
        os.environ["MLX_RANK"] = str(rank)
        os.environ["MLX_HOSTFILE"] = str(hostfile)
        faulthandler.dump_traceback_later(deadline_s, exit=True, file=out)
        try:
            group = mx.distributed.init(strict=True, backend=BACKEND)
        except RuntimeError as exc:
            raise EngineError(f"rank {rank} could not join the tensor-parallel ring at "
                              f"{hosts[rank]}: {exc}") from exc
        finally:
            faulthandler.cancel_dump_traceback_later()
            for name in ("MLX_RANK", "MLX_HOSTFILE"):
                os.environ.pop(name, None)
    if group.size() != len(hosts) or group.rank() != rank:
        raise EngineError(f"the ring says rank {group.rank()} of {group.size()}; this "
                          f"worker is rank {rank} of {len(hosts)}")
    return group
