"""Discovery: finding candidate peers (static addresses, signed mDNS records) and
keeping the candidate table; the authenticated handshake decides membership.

Names are loaded on first use: the config reads ``settings`` and ``static``
without importing zeroconf or the network shell.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT_CLUSTER_NAME": "settings", "DISCOVERY_MODES": "settings",
    "cluster_settings": "settings", "parse_cluster_name": "settings",
    "parse_peers": "static",
    "Candidate": "candidates", "CandidateTable": "candidates",
    "DiscoveryService": "service",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
