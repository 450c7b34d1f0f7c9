"""``mlxctl cluster``: the cluster as this daemon sees it.

``nodes`` lists the candidate peers discovery proposed (static peers and mDNS
records) with what their last inventory poll found; exit codes as every
command (0 ok, 1 failure, 3 daemon not running, 4 permission denied). A peer
that is unreachable or refused is a row in the answer, not a failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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


@cluster_app.command()
def plan(ctx: typer.Context,
         model: Annotated[str, typer.Option("--model", help="The model directory (a local "
                                            "mlx-lm checkpoint; the same on every host).")],
         stages: Annotated[int, typer.Option("--stages", min=1, max=64,
                                             help="How many pipeline stages.")],
         cluster_config_out: Annotated[Path | None, typer.Option(
             "--cluster-config-out", help="Write the plan as a cluster TOML here; "
             "mlxceld --distributed-config accepts it unchanged.")] = None,
         socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Plan a pipeline over the reachable peers (stage, node, address, layers, bytes,
    headroom) and assign nothing. A plan that does not fit names the shortfall per node."""
    resolved = str(Path(model).expanduser().absolute()) if Path(model).expanduser().exists() \
        else model
    body = call(socket_path(ctx, socket), as_json,
                lambda c: c.plan_cluster(resolved, stages))
    if cluster_config_out is not None:
        cluster_config_out.write_text(body["toml"])
    emit(as_json, "cluster-plan", body, lambda: render.cluster_plan(body))
