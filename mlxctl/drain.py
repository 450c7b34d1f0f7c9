"""``mlxctl drain`` and ``mlxctl undrain``, in the spirit of ``nomad node drain``.

A drain refuses new requests that need the node (503 "draining" with Retry-After), lets
the running ones finish, and at the deadline ends the rest with a clear error. The
command waits until the node is drained (``--detach``: it returns once the drain is
recorded), polling every ``POLL_S``, for at most the deadline plus ``WAIT_SLACK_S``.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Annotated, Any

import typer

from mlxceld.control.clients.typed import ControlClient
from mlxctl.edge import EXIT_FAILURE, EXIT_USAGE, call, echo, emit
from mlxctl.options import JsonOpt, SocketOpt, socket_path

POLL_S = 0.2
WAIT_SLACK_S = 30.0  # past the deadline, the router's last requests still have to end
NO_DEADLINE_WAIT_S = 24 * 3600.0  # how long a drain without a deadline is waited for
DEFAULT_DEADLINE = "1h"  # nomad's default
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")

NodeArg = Annotated[str | None, typer.Argument(
    help="The node id (see `mlxctl cluster nodes`); default: this daemon's own node.")]


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``5m``, ``1h30m``, ``250ms`` -> seconds; ValueError otherwise."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration: write e.g. 30s, 5m, 1h30m or a "
                         "number of seconds")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def drain(
    ctx: typer.Context,
    node: NodeArg = None,
    deadline: Annotated[str, typer.Option(
        "--deadline", help="How long running requests may take before they are ended "
        "(30s, 5m, 1h30m, or seconds).")] = DEFAULT_DEADLINE,
    no_deadline: Annotated[bool, typer.Option(
        "--no-deadline", help="Never end running requests: wait for them.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="End running requests at once, with an error.")] = False,
    detach: Annotated[bool, typer.Option(
        "--detach", help="Return once the drain is recorded; do not wait for it.")] = False,
    socket: SocketOpt = None, as_json: JsonOpt = False,
) -> None:
    """Drain NODE: refuse new requests that need it (503 "draining"), let running ones
    finish, end the rest at the deadline. The drain survives a restart of the daemon;
    `mlxctl undrain` ends it."""
    try:
        seconds = None if no_deadline else parse_duration(deadline)
    except ValueError as exc:
        echo(f"error: --deadline: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    path = socket_path(ctx, socket)
    body = call(path, as_json, lambda c: c.drain(node, seconds, force))
    row = body["drain"]
    if not detach:
        wait_s = (NO_DEADLINE_WAIT_S if seconds is None else 0.0 if force else seconds)
        row = call(path, as_json, lambda c: _wait_drained(c, row["node_id"],
                                                            wait_s + WAIT_SLACK_S))
        body["drain"] = row
    emit(as_json, "drain", body, lambda: describe(row))
    if not detach and row.get("state") != "drained":
        raise typer.Exit(EXIT_FAILURE)


def undrain(ctx: typer.Context, node: NodeArg = None, socket: SocketOpt = None,
            as_json: JsonOpt = False) -> None:
    """End NODE's drain: requests that need it are admitted again."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.undrain(node))
    was = body.get("was")
    emit(as_json, "undrain", body, lambda: f"node {body['node']} undrained (was "
         f"{was['state']})" if was else f"node {body['node']} was not draining; nothing "
         "changed")


def describe(row: dict[str, Any]) -> str:
    node = row["node_id"]
    if row["state"] == "drained":
        took = row["updated_at"] - row["started_at"]
        return (f"node {node} drained in {took:.1f} s: {row['finished']} requests finished, "
                f"{row['ended']} ended at the deadline ({row['reason']})")
    if row["state"] == "draining":
        until = ("no deadline" if row["deadline"] is None
                 else f"deadline {time.strftime('%H:%M:%S', time.localtime(row['deadline']))}")
        senders = ", ".join(f"{s.get('sequences')} from {s.get('sender')}"
                            for s in row.get("senders") or [] if isinstance(s, dict))
        still = f"; still running: {senders}" if senders else ""
        return f"node {node} is draining ({until}{still}); see: mlxctl drain {node} (waits)"
    return f"node {node}: {row['state']}"


async def _wait_drained(client: ControlClient, node: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    row: dict[str, Any] = {"node_id": node, "state": "missing"}
    while time.monotonic() < deadline:
        rows = (await client.drains())["drains"]
        row = next((r for r in rows if r["node_id"] == node), {"node_id": node,
                                                                "state": "undrained"})
        if row["state"] != "draining":
            break
        await asyncio.sleep(POLL_S)
    return row
