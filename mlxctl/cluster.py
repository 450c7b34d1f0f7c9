"""``mlxctl cluster``: the cluster as this daemon sees it.

``nodes`` lists the candidate peers discovery proposed (static peers and mDNS
records) with what their last inventory poll found; exit codes as every
command (0 ok, 1 failure, 3 daemon not running, 4 permission denied). A peer
that is unreachable or refused is a row in the answer, not a failure.

``activate`` plans like ``plan``, then has the daemon push the plan (the
two-phase assignment of ``--pp-auto``) and serve its router over it; it polls
``status`` every ``POLL_S`` and prints each peer's step as it happens. Its
waits: ``PUSH_WAIT_S`` for the push to end (the daemon bounds it by
``coordinator_round.PUSH_S``), then ``ROUTER_WAIT_S`` for the router to run. Once
the plan is decided activate, a peer that was lost is re-dialled for up to
``coordinator_round.ACTIVATE_FOR_S`` (it reads ``unreachable``): should the push
outlast ``PUSH_WAIT_S`` so, this command stops waiting and says the daemon goes on.

``deactivate`` ends the latest plan everywhere (``cluster/assignment/deactivation.py``): it
prints each peer's outcome and exits 0 when every peer stopped its stage, 1
when one could not be told (named, with the reason; it learns later), 5 while
a bring-up is in progress. The daemon answers within its own bounds
(``control.client.DEACTIVATE_TIMEOUT_S``).

``link-test PEER`` has the daemon measure its link with a peer's agent (``net/link.py``):
round trips, then bytes each way; 1 when the peer cannot be reached or stalls (named, with
why), 2 for a PEER, ``--pings`` or ``--size`` out of bounds.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from rich.console import Console

from mlxceld.cluster.assignment.coordinator_round import PUSH_S
from mlxceld.control.clients.typed import ControlClient
from mlxceld.errors import ControlError
from mlxceld.types import (
    DEFAULT_MESH,
    MAX_LINK_MIB,
    MAX_LINK_PINGS,
    MAX_REPLICAS,
    MESH_MODES,
    WorkerState,
)
from mlxctl import render
from mlxctl.edge import EXIT_FAILURE, EXIT_USAGE, call, emit, fail
from mlxctl.options import JsonOpt, SocketOpt, socket_path
from mlxctl.progress import LoadView

EXIT_BUSY: Final = 5  # `cluster activate`: another bring-up is in progress
POLL_S: Final = 0.5
# The push's own bound, and the serving after it; from the last time a loading peer's
# load was heard to advance, when that is later (a big stage loads for minutes).
PUSH_WAIT_S: Final = PUSH_S + 30.0
ROUTER_WAIT_S: Final = 180.0  # the router loads the tokenizer and attaches to the stages
# A router's start has come to rest: it runs, or its supervisor gave up (BACKOFF retries).
SETTLED: Final = frozenset({WorkerState.RUNNING, WorkerState.FAILED})

cluster_app = typer.Typer(help="The cluster: candidate peers found by discovery, plans, "
                          "bring-up.", no_args_is_help=True, rich_markup_mode=None)


ReplicasOpt = Annotated[int, typer.Option(
    "--replicas", min=1, max=MAX_REPLICAS,
    help="How many replicas: whole copies of the model, each a pipeline of --stages stages "
    "on peers of its own, behind the one router (needs replicas x stages peers).")]


def _mesh_choice(value: str) -> str:
    if value not in MESH_MODES:
        raise typer.BadParameter(f"{value!r} is not a mesh: give one of "
                                 f"{', '.join(MESH_MODES)}")
    return value


MeshOpt = Annotated[str, typer.Option(
    "--mesh", callback=_mesh_choice, metavar="pp|tp|2d|auto",
    help="How the --stages N hosts run the model: pp, a pipeline of N stages (the "
    "default); tp, one tensor group of N ranks; 2d, P stages of T ranks (P x T = N, T = 2 "
    "when N is even); auto, every P x T = N the model splits over, the least predicted "
    "time per token (a pipeline when the peers did not report compute units). The meshes "
    "considered and why one was chosen are shown.")]

@cluster_app.command()
def nodes(ctx: typer.Context, socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """List candidate peers: node id, address, version, key id, memory, compute units (as
    the peer reported them; plans weigh them), state, last seen, and the failure
    detector's liveness (alive, suspect, dead) since when."""
    body = call(socket_path(ctx, socket), as_json, lambda c: c.cluster_nodes())
    emit(as_json, "cluster_nodes", body, lambda: render.cluster_nodes(body))


@cluster_app.command()
def plan(ctx: typer.Context,
         model: Annotated[str, typer.Option("--model", help="The model: a local mlx-lm "
                                            "checkpoint directory (the same on every host), or "
                                            "a Hugging Face repo id.")],
         stages: Annotated[int, typer.Option("--stages", min=1, max=64,
                                             help="How many pipeline stages.")],
         replicas: ReplicasOpt = 1,
         mesh: MeshOpt = DEFAULT_MESH,
         cluster_config_out: Annotated[Path | None, typer.Option(
             "--cluster-config-out", help="Write the plan as a cluster TOML here; "
             "mlxceld --distributed-config accepts it unchanged.")] = None,
         socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Plan a pipeline over the reachable peers (stage, node, address, layers, bytes,
    headroom) and assign nothing. A plan that does not fit names the shortfall per node.
    With --replicas R: R pipelines of --stages stages each, every one a whole copy of the
    model, on R x stages peers. With --mesh tp, 2d or auto: --stages hosts, as stages
    whose ranks split each layer (tensor parallelism), each rank's memory checked."""
    resolved = _local(model)
    body = call(socket_path(ctx, socket), as_json,
                lambda c: c.plan_cluster(resolved, stages, replicas, mesh))
    if cluster_config_out is not None:
        cluster_config_out.write_text(body["toml"])
    emit(as_json, "cluster_plan", body, lambda: render.cluster_plan(body))


@cluster_app.command(epilog="Exit codes: 0 every stage is active and the router serves; "
                     "1 the bring-up failed (each peer that failed is named, with its "
                     "reason) or the router did not start; 2 usage; 3 daemon not running; "
                     "4 permission denied; 5 another bring-up is in progress.")
def activate(ctx: typer.Context,
             model: Annotated[str, typer.Option("--model", help="The model: a local "
                                                "mlx-lm checkpoint directory (the same on "
                                                "every host), or a Hugging Face repo id (each "
                                                "host fetches what it needs).")],
             stages: Annotated[int, typer.Option("--stages", min=1, max=64,
                                                 help="How many pipeline stages.")],
             replicas: ReplicasOpt = 1,
             mesh: MeshOpt = DEFAULT_MESH,
             socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Plan a pipeline, assign its stages to the peers and serve the router over it
    (--replicas R: R pipelines, each a whole copy of the model, behind the one router).

    Plans as `cluster plan` does, then assigns the stages two-phase (offer, prepare,
    commit, activate: every peer or none), printing each peer's step and how far each
    loads its stage (a bar per peer on a terminal, else a line per tenth), and waits for the
    router. The peers run `mlxceld --pp-peer` with the same cluster secret. Waits at most
    90 s for the assignment (from the last advance of a peer's load, while one loads),
    then 180 s for the router."""
    resolved = _local(model)
    outcome = call(socket_path(ctx, socket), as_json,
                   lambda c: _activate(c, resolved, stages, as_json, replicas, mesh))
    if "refused" in outcome:
        err: ControlError = outcome["refused"]
        fail(as_json, EXIT_BUSY, err.code, err.message, err.hint)
    bringup, router = outcome["bringup"], outcome["router"]
    ok = bringup.get("state") == "active" and router.get("state") == WorkerState.RUNNING
    if as_json:
        typer.echo(json.dumps({"schema": "mlxctl.cluster_activate/1", "ok": ok,
                               "bringup": bringup, "router": router,
                               "serving": outcome["serving"]}, indent=2))
    elif ok:
        serving = outcome["serving"] or {}
        typer.echo(f"{bringup['summary']}; serving {serving.get('model_name')} at "
                   f"{serving.get('url')}")
    elif bringup.get("state") == "active":
        typer.echo(f"mlxctl: {bringup['summary']}, but the router is "
                   f"{router.get('state')}: {router.get('reason') or 'no reason given'}",
                   err=True)
        typer.echo("  hint: see: mlxctl logs router", err=True)
    else:
        typer.echo(f"mlxctl: bring-up failed: {bringup.get('summary')}", err=True)
        for p in bringup.get("peers") or []:
            if p["state"] == "failed":
                typer.echo(f"  {p['address']} ({p['stage']}): {p['reason']}", err=True)
    if not ok:
        raise typer.Exit(EXIT_FAILURE)


@cluster_app.command(epilog="Exit codes: 0 every peer stopped its stage and the router is "
                     "stopped; 1 a peer could not be told (each is named, with the reason), "
                     "or there is no plan to end; 2 usage; 3 daemon not running; 4 permission "
                     "denied; 5 a bring-up is in progress.")
def deactivate(ctx: typer.Context, socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """End the plan this daemon pushed: every peer stops its stage (freeing its memory) and
    the router stops; the daemons keep running.

    The plan is recorded as deactivated first, so that no restart brings it back. A peer
    that cannot be told is named (exit 1); it learns later: the daemon tries it again
    every 20 s for an hour, and a peer daemon that restarts asks before bringing a stage
    back. Running deactivate again tells every peer again."""
    body = call(socket_path(ctx, socket), as_json, _deactivate)
    if "refused" in body:
        err: ControlError = body["refused"]
        fail(as_json, EXIT_BUSY, err.code, err.message, err.hint)
    state = body["bringup"]
    ok = all(p["state"] == "deactivated" for p in state.get("peers") or [])
    if as_json:
        typer.echo(json.dumps({**body, "schema": "mlxctl.cluster_deactivate/1", "ok": ok},
                              indent=2))
    else:
        for p in state.get("peers") or []:
            typer.echo(render.peer_step(p), err=p["state"] != "deactivated")
        typer.echo(state["summary"] if ok else f"mlxctl: {state['summary']}", err=not ok)
        if state.get("note"):
            typer.echo(f"note: {state['note']}")
        if not ok:
            typer.echo("  hint: each peer not told learns it when its daemon restarts, or "
                       "when this daemon reaches it (every 20 s for an hour); mlxctl cluster "
                       "deactivate again tells every peer again", err=True)
    if not ok:
        raise typer.Exit(EXIT_FAILURE)


@cluster_app.command("link-test", epilog="Exit codes: 0 measured; 1 the peer could not be "
                     "reached, stalled or refused (named, with why); 2 usage; 3 daemon not "
                     "running; 4 permission denied.")
def link_test(ctx: typer.Context,
              peer: Annotated[str, typer.Argument(
                  metavar="PEER", help="A node id of `mlxctl cluster nodes`, or a peer's "
                  "agent address host[:port] (port 19000 when left out).")],
              pings: Annotated[int, typer.Option(
                  "--pings", min=1, max=MAX_LINK_PINGS, metavar="N",
                  help="How many round trips to time.")] = 20,
              size: Annotated[int, typer.Option(
                  "--size", min=1, max=MAX_LINK_MIB, metavar="MIB",
                  help="MiB to send to the peer, and as many back.")] = 16,
              socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Measure the link between this daemon's host and a peer's: round trips (min, median,
    p90, max) and bandwidth each way, over the cluster's authenticated, encrypted agent
    channel.

    The daemon dials the peer's agent as its own, times --pings pings one after the other,
    sends --size MiB in 1 MiB messages (each acknowledged) and has the peer send as many
    back. Bounds: 3 s to connect, 5 s for each answer, 60 s for the whole measurement."""
    if not peer or len(peer) > 255 or not peer.isprintable():
        fail(as_json, EXIT_USAGE, "bad_peer", f"PEER {peer!r} is not a node id or an agent "
             "address", "name a node id of `mlxctl cluster nodes`, or host[:port]")
    body = call(socket_path(ctx, socket), as_json, lambda c: c.link_test(peer, pings, size))
    emit(as_json, "cluster_link_test", body, lambda: _link_text(body))


def _link_text(body: dict[str, Any]) -> str:
    """The link test as text: the peer, its round trips and both transfers."""
    rtt, node = body["rtt_ms"], body.get("node_id")
    named = body["address"] if body["peer"] == body["address"] else \
        f"{body['peer']} ({body['address']})"
    lines = [f"link with {named}" + (f", node {node}" if node and node != body["peer"]
                                      else ""),
             f"  connect     {body['connect_ms']:.1f} ms",
             f"  round trip  min {rtt['min']:.3f}  median {rtt['median']:.3f}  p90 "
             f"{rtt['p90']:.3f}  max {rtt['max']:.3f} ms ({rtt['count']} pings)"]
    for label, t in (("sent", body["sent"]), ("received", body["received"])):
        lines.append(f"  {label:<10}  {t['bytes'] / 1e6:.1f} MB in {t['seconds']:.3f} s: "
                     f"{t['mb_per_s']:.1f} MB/s")
    return "\n".join(lines)


async def _deactivate(c: ControlClient) -> dict[str, Any]:
    try:
        return await c.deactivate_cluster()
    except ControlError as exc:
        if exc.code == "bringup_in_progress":
            return {"refused": exc}
        raise


async def _activate(c: ControlClient, model: str, stages: int,
                    quiet: bool, replicas: int = 1, mesh: str = DEFAULT_MESH
                    ) -> dict[str, Any]:
    """Start the bring-up, print each peer's step until it ends, then wait for the router."""
    try:
        started = (await c.activate_cluster(model, stages, replicas, mesh))["bringup"]
    except ControlError as exc:
        if exc.code == "bringup_in_progress":
            return {"refused": exc}
        raise
    epoch = started["epoch"]
    if not quiet:
        typer.echo(f"plan {epoch}: {len(started['peers'])} stage(s) of {started['model']}")
    read: dict[str, int] = {}  # the bytes its load had read, as last heard, per peer
    view = LoadView(typer.echo, Console() if not quiet and sys.stdout.isatty() else None)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + PUSH_WAIT_S
    try:
        while True:
            status = await c.status()
            bringup = status.get("bringup") or {}
            if not quiet:
                view.peers(bringup.get("peers") or [])
            for p in bringup.get("peers") or []:
                done = (p.get("loading") or {}).get("done")
                if isinstance(done, int) and done > read.get(p["address"], -1):
                    read[p["address"]] = done  # a load that advances is waited for
                    give_up = max(give_up, loop.time() + PUSH_WAIT_S)
            if bringup.get("epoch") != epoch or bringup.get("state") not in ("planning",
                                                                              "pushing"):
                break
            if loop.time() > give_up:
                going_on = ("; the daemon keeps at it (a peer is unreachable, re-dialled)"
                            if any(p.get("state") == "unreachable"
                                   for p in bringup.get("peers") or []) else "")
                bringup = {**bringup, "state": "failed", "summary": f"plan {epoch} did not end "
                           f"within {PUSH_WAIT_S:g} s{going_on} (see: mlxctl status, "
                           "mlxctl events)"}
                break
            await asyncio.sleep(POLL_S)
    finally:
        view.close()
    router: dict[str, Any] = {"state": "not started"}
    if bringup.get("state") == "active":
        router = await _wait_router(c)
        status = await c.status()
    return {"bringup": bringup, "router": router, "serving": status.get("serving")}


async def _wait_router(c: ControlClient) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + ROUTER_WAIT_S
    router: dict[str, Any] = {"state": "missing"}
    while loop.time() < give_up:
        workers = (await c.workers())["workers"]
        router = next((w for w in workers if w["name"] == "router"), {"state": "missing"})
        if router["state"] in SETTLED:
            break
        await asyncio.sleep(POLL_S)
    return router


def _local(model: str) -> str:
    """A local directory as an absolute path: the daemon has another working directory."""
    path = Path(model).expanduser()
    return str(path.absolute()) if path.exists() else model
