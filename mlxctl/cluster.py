"""``mlxctl cluster``: the cluster as this daemon sees it.

``nodes`` lists the candidate peers discovery proposed (static peers and mDNS
records) with what their last inventory poll found; exit codes as every
command (0 ok, 1 failure, 3 daemon not running, 4 permission denied). A peer
that is unreachable or refused is a row in the answer, not a failure.
"""

from __future__ import annotations

import typer

from mlxctl import render
from mlxctl.edge import JsonOpt, SocketOpt, call, emit, socket_path

cluster_app = typer.Typer(help="The cluster: candidate peers found by discovery.",
                          no_args_is_help=True)


@cluster_app.command()
def nodes(ctx: typer.Context, socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """List candidate peers: node id, address, version, key id, memory, state, last seen."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.cluster_nodes())
    emit(as_json, "cluster-nodes", body, lambda: render.cluster_nodes(body))
