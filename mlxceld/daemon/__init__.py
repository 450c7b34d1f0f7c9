"""The daemon room: the composition root (``root.py``: ``Daemon``, its start-up, signals
and the one shutdown order) and its windows, each the daemon's side of one concern:
which workers run (``roster.py``), what its router serves (``serving.py``), `mlxctl
drain|undrain` (``draining.py``), its stage worker watched (``stage_watch.py``) and a
router's replicas found by discovery (``replica_peers.py``).

Names are loaded on first use, as in ``control/``: ``preflight`` reads the serving
window's checks without importing the root (uvicorn, the control API, the cluster).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Daemon": "root", "Terminal": "root", "serve": "root", "SHUTDOWN_SLACK_S": "root",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
