"""Discovery: finding candidate peers (static addresses, signed mDNS records), asking
each for its inventory (``inventory``, ``poller``) and keeping the candidate table;
the authenticated handshake decides membership. The failure detector (``detector``)
and its heartbeats (``heartbeat``) say which of them answer now.

Names are loaded on first use, so that importing one module of the room does not
import zeroconf.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Candidate": "candidates", "CandidateTable": "candidates",
    "DiscoveryService": "service",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
