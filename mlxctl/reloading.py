"""``mlxctl reload``: the daemon re-reads its config file, as SIGHUP (``systemctl reload``)
makes it, and says what changed; a file that does not load is refused with its error
(exit 1) and the running config stays."""

from __future__ import annotations

import json
from typing import Any

import typer

from mlxctl.edge import call, emit
from mlxctl.options import JsonOpt, SocketOpt, socket_path

EPILOG = ("Exit codes: 0 reloaded (or nothing changed); 1 the file does not load (the "
          "daemon's error is printed; the running config stays); 3 daemon not running; 4 "
          "permission denied.")


def reload(ctx: typer.Context, socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Re-read the daemon's config file, as SIGHUP does, and print what changed. Workers are
    not restarted: a changed one takes its settings at its next start, an added one starts,
    a removed one stops."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.reload())
    emit(as_json, "reload", body, lambda: describe(body))


def describe(body: dict[str, Any]) -> str:
    source = body.get("config_file") or "no config file (flags and defaults)"
    changes = body.get("changed") or []
    if not changes:
        return f"reloaded {source}: nothing changed"
    later = set(body.get("at_next_start") or [])
    lines = [f"reloaded {source}: {len(changes)} setting(s) changed"]
    for c in changes:
        note = " (takes effect at the next start)" if c["key"] in later else ""
        lines.append(f"  {c['key']}: {_shown(c['old'])} -> {_shown(c['new'])}{note}")
    return "\n".join(lines)


def _shown(value: Any) -> str:
    return "(none)" if value is None else json.dumps(value)
