"""Turning the daemon's answers into text for a person: tables, durations, colour.

Colour only on a terminal, and never with NO_COLOR set (https://no-color.org). The
escape codes are click's (``typer.style``), written here: ``status`` does not import typer.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from mlxceld.types import LoadProgress, WorkerState, load_progress, loading_text
from mlxctl.drain_view import drain_line, drain_lines
from mlxctl.engine_view import count, speculation_lines, stage_speculation
from mlxctl.tensor_view import tensor_lines
from mlxctl.timetext import duration, since

PEER_COLORS = {"reachable": "green", "discovered": "cyan", "unreachable": "yellow",
               "refused": "red"}
LIVENESS_COLORS = {"alive": "green", "unknown": "cyan", "suspect": "yellow", "dead": "red"}
REPLICA_COLORS = {"up": "green", "connecting": "cyan", "down": "red"}
LINK_COLORS = {"attached": "green", "connecting": "cyan", "standby": "cyan",
               "disconnected": "yellow", "unreachable": "yellow", "refused": "red",
               "model_mismatch": "red", "layers_mismatch": "red", "failed": "red",
               "silent": "red"}
ANSI_COLORS = {"black": 30, "red": 31, "green": 32, "yellow": 33, "blue": 34, "magenta": 35,
               "cyan": 36, "white": 37}
STATE_COLORS = {WorkerState.RUNNING: "green", WorkerState.STARTING: "cyan",
                WorkerState.BACKOFF: "yellow", WorkerState.STOPPING: "yellow",
                WorkerState.EXITED: "white", WorkerState.FAILED: "red"}
# A status's parts of a pipeline's takeover, each shown as its label and its summary (the
# part's other keys are for --json): a router in front of a pipeline (daemon/following.py),
# a standby coordinator (daemon/standby.py), a coordinator a standby superseded
# (cluster/fencing.py).
TAKEOVER_LINES = (("front", "front"), ("standby", "standby"),
                  ("stood_down", "coordinator: stood down"))


def color_enabled() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def paint(text: str, color: str | None, *, bold: bool = False) -> str:
    if not color_enabled() or (color is None and not bold):
        return text
    return style(text, color, bold=bold)


def style(text: str, color: str | None, *, bold: bool = False) -> str:
    """``text`` in ``color`` (a name of ``ANSI_COLORS``), bold or not (both say so, as
    ``typer.style(text, fg=color, bold=bold)`` does), then a reset."""
    fg = f"\033[{ANSI_COLORS[color]}m" if color else ""
    return fg + ("\033[1m" if bold else "\033[22m") + text + "\033[0m"


def size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit in ("B", "KiB") else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]],
          colors: Sequence[Sequence[str | None]] | None = None) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(paint(h.ljust(w), None, bold=True) for h, w in zip(headers, widths,
                                                                         strict=True)).rstrip()]
    for i, row in enumerate(rows):
        cells = []
        for j, (cell, w) in enumerate(zip(row, widths, strict=True)):
            c = colors[i][j] if colors else None
            cells.append(paint(cell.ljust(w), c))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def workers_table(workers: list[dict[str, Any]]) -> str:
    if not workers:
        return "no workers configured (the daemon is idle: control plane only)"
    now = time.time()
    headers = ["NAME", "ROLE", "STATE", "PID", "RESTARTS", "UPTIME", "RSS", "LAST EXIT"]
    rows, colors = [], []
    for w in workers:
        running = w["state"] == WorkerState.RUNNING
        state = "running (unhealthy)" if running and w.get("healthy") is False else w["state"]
        up = now - w["started_at"] if running and w.get("started_at") else None
        rows.append([w["name"], w["role"], state, str(w["pid"] or "-"), str(w["restarts"]),
                     duration(up), size(w.get("rss_bytes")), w.get("last_exit") or "-"])
        colors.append([None, None, STATE_COLORS.get(w["state"]), None, None, None, None, None])
    return table(headers, rows, colors)


def worker_groups(workers: list[dict[str, Any]]) -> list[str]:
    """Each worker group (``group``: a tensor-parallel group's ranks, restarted together):
    a line saying its ranks and whether all run, and each rank's worker, state, pid, RSS."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        if w.get("group"):
            groups.setdefault(w["group"], []).append(w)
    out: list[str] = []
    for name, members in groups.items():
        members = sorted(members, key=_rank)
        tensor = any(w["role"] in ("tp", "stage_tp") for w in members)
        kind = f"tensor group {name}: {len(members)} ranks" if tensor else \
            f"group {name}: {len(members)} workers"
        who = ", ".join(f"{w['name']} = rank {_rank(w)}" if i == 0 else w["name"]
                        for i, w in enumerate(members)) if tensor else \
            ", ".join(w["name"] for w in members)
        down = [w for w in members if w["state"] != WorkerState.RUNNING]
        if not down:
            how = "all running"
        else:
            how = (f"{len(members) - len(down)} of {len(members)} running ("
                   + ", ".join(f"{w['name']} {w['state']}" for w in down)
                   + "): it serves once every member runs; a member's failure restarts "
                   "them all")
        rank = ["RANK"] if tensor else []
        rows = [[*([str(_rank(w))] if tensor else []), w["name"], w["state"],
                 str(w["pid"] or "-"), size(w.get("rss_bytes"))] for w in members]
        colors = [[*_blank(rank), None, STATE_COLORS.get(w["state"]), None, None]
                  for w in members]
        out += ["", f"{kind} ({who}), {how}", *_transport(members),
                table([*rank, "WORKER", "STATE", "PID", "RSS"], rows, colors)]
    return out


def _transport(members: list[dict[str, Any]]) -> list[str]:
    """The line naming the backend a tensor group's rank 0 chose, and why (none before
    it has)."""
    for w in members:
        tensor = (w.get("stats") or {}).get("tensor") or {}
        if tensor.get("transport"):
            return [f"transport: {tensor['transport']} ({tensor.get('transport_reason')})"]
    return []


def _rank(w: dict[str, Any]) -> int:
    """A tensor-parallel member's rank: its stats' (``tensor``), else its role's and name's
    (the router or the stage is rank 0, ``tp-N`` and ``stage-tp-N`` rank N)."""
    tensor = (w.get("stats") or {}).get("tensor") or {}
    if isinstance(tensor.get("rank"), int):
        return int(tensor["rank"])
    tail = w["name"].rsplit("-", 1)[-1]
    return int(tail) if w["role"] in ("tp", "stage_tp") and tail.isdigit() else 0


def cluster_nodes(body: dict[str, Any]) -> str:
    """The candidate peers of ``GET /v1/cluster/nodes`` as a table, with discovery's line."""
    d = body["discovery"]
    head = (f"cluster {body['cluster']} · node {body['node_id']} · key "
            f"{body.get('key_id') or '-'} · discovery {d['mode']} "
            + (f"on {d['address']}" if d["running"] else "(not running)"))
    if d.get("interface"):  # [daemon] cluster_interface: the link this node announces
        head += f" · link {d['interface']}"
    lines = [head] + ([f"  {paint('x', 'red')} {d['error']}"] if d.get("error") else [])
    nodes = body["nodes"]
    if not nodes:
        return "\n".join([*lines, "", "no candidate peers yet (see --cluster-peers and "
                           "--cluster-discovery mdns)"])
    now = time.time()
    headers = ["NODE", "ADDRESS", "VERSION", "KEY", "MEMORY (AVAIL/TOTAL)", "UNITS", "LINK",
               "STATE", "LAST SEEN", "SOURCE", "LIVENESS", "SINCE"]
    rows, colors, errors = [], [], []
    for n in nodes:
        memory = (f"{size(n['memory_available'])} / {size(n['memory_total'])}"
                  if n.get("memory_total") is not None else "-")
        seen = duration(now - n["last_seen"]) + " ago" if n.get("last_seen") else "never"
        live = n.get("liveness") or {}
        units = (n.get("inventory") or {}).get("compute_units")  # a peer that reported them
        rows.append([n.get("node_id") or "-", n["address"], n.get("version") or "-",
                     n.get("key_id") or "-", memory, f"{units:g}" if units else "-",
                     (n.get("link") or {}).get("interface") or "-", n["state"], seen, n["source"],
                     live.get("state") or "-", since(live.get("since"), now)])
        colors.append([None, None, None, "red" if n.get("key_stale") else None, None, None, None,
                       PEER_COLORS.get(n["state"]), None, None,
                       LIVENESS_COLORS.get(live.get("state") or ""), None])
        if n.get("key_stale"):
            errors.append(f"  node {n.get('node_id') or '?'} ({n['address']}) dials with key "
                          f"{n['key_id']}, this node with {body.get('key_id')}: it missed a "
                          "secret rotation; on it, mlxctl secret install FILE --primary with "
                          "this cluster's secret")
        if n.get("error") and n["state"] in ("unreachable", "refused"):
            errors.append(f"  {n['address']}: {n['error']}")
    listed = {n["address"] for n in nodes}
    for live in body.get("liveness") or []:  # a plan's peer that is no candidate (any more)
        if live["address"] not in listed:
            errors.append(f"  {live['address']} (a plan's peer): {live['state']} since "
                          f"{since(live['since'], now)}")
        if live["state"] in ("suspect", "dead"):
            errors.append(f"  {live['address']}: {live['state']}: {live['reason']}")
    return "\n".join([*lines, _detector(body.get("detector")), "",
                      table(headers, rows, colors), *errors])


def _detector(d: dict[str, Any] | None) -> str:
    if not d:
        return "failure detector: -"
    return (f"failure detector {'running' if d['running'] else '(not running)'}: ping every "
            f"{d['ping_interval_s']:g} s, suspect after {d['suspect_after_s']:g} s, dead "
            f"after {d['dead_after_s']:g} s without an answer")


def compute_units(speed: dict[str, Any]) -> str:
    """``daemon.compute_units`` (mlxceld/discovery/speed.py) as one line."""
    if speed["units"] is not None:
        how = ("declared" if speed["source"] == "declared"
               else f"measured in {speed['dtype']}")
        return f"compute units: {speed['units']:g} ({how})"
    if speed["source"] == "measuring":
        return f"compute units: measuring (in {speed['dtype']})"
    return ("compute units: not measured" + (f": {speed['error']}" if speed.get("error")
                                             else "") + " (plans split by memory)")


def status(body: dict[str, Any]) -> str:
    d = body["daemon"]
    workers = body["workers"]
    running = sum(1 for w in workers if w["state"] == WorkerState.RUNNING)
    state = paint(d["state"], "green" if d["state"] == "running" else "yellow")
    summary = (f"mlxceld {d['version']} {state} · node {d['node_id']} · pid {d['pid']} · "
               f"up {duration(d['uptime_s'])} · {len(workers)} worker(s), {running} running")
    serving = body.get("serving")
    lines = [summary]
    speed = d.get("compute_units")
    if isinstance(speed, dict) and (speed["source"] != "unmeasured" or speed.get("error")):
        lines.append(compute_units(speed))  # none on a daemon that never measured
    # A prefill or decode node's router worker says its role (workers/handoff_node.py).
    role = next((w["stats"]["node_role"] for w in workers
                 if isinstance(w.get("stats"), dict) and w["stats"].get("node_role")), None)
    router: dict[str, Any] = next((w["stats"] for w in workers if w.get("name") == "router"
                                   and isinstance(w.get("stats"), dict)), {})
    if serving and not role:
        context = router.get("context_length")  # the router's, once it has loaded the model
        lines.append(f"serving {serving['model_name']}"
                     + (f" (context {context} tokens)" if isinstance(context, int) else "")
                     + f" at {serving['url']}"
                     + (" (API key required)" if serving.get("api_key") else ""))
    listener = next((w["stats"]["serving"] for w in workers
                     if isinstance(w.get("stats"), dict) and w["stats"].get("serving")), None)
    if listener and role:
        lines.append(f"{role} node: serving listener at {listener} (for the cluster's "
                     "routers; no OpenAI port)")
    elif listener:  # the router's serving listener (workers/router.py): routers send it work
        lines.append(f"serving listener at {listener} (for the cluster's routers)")
    if isinstance(router.get("prompt_cache"), dict):
        lines.append(prompt_cache(router["prompt_cache"]))
    lines += speculation_lines(router.get("speculative"))
    lines += [f"{label}: {part['summary']}" for key, label in TAKEOVER_LINES
              if (part := body.get(key))]
    lines += tensor_lines(body.get("tensor"))
    cluster = body.get("cluster")
    if cluster:
        where = (f"layers [{cluster['layers'][0]}, {cluster['layers'][1]})"
                 if cluster.get("layers") else f"{cluster['stages']} stage(s)")
        lines.append(f"cluster {cluster['name']}: node {cluster['node']} ({cluster['role']}, "
                     f"{where}) at {cluster['address']}")
    assignment = body.get("assignment")
    if assignment:
        lines.append(f"assignment: plan {assignment['epoch']}, {assignment['stage']} "
                     f"{assignment['state']} (coordinator {assignment['coordinator']})"
                     + (f": {assignment['reason']}" if assignment.get("reason") else ""))
    bringup = body.get("bringup")
    if bringup:
        lines.append(f"bring-up: {bringup['state']}"
                     + (f": {bringup['summary']}" if bringup.get("summary") else ""))
        if bringup.get("config_differs"):
            lines.append(f"  config differs: {bringup['config_differs']} (resumed as it was; "
                         "to apply the config, mlxctl cluster activate re-plans now, or "
                         "deactivate, then restart)")
        lines += [peer_step(p) for p in bringup.get("peers") or []]
    healing = body.get("healing")
    if healing and healing.get("state") not in (None, "off", "idle"):
        lines.append(f"self-healing: {healing['state']}"
                     + (f": {healing['summary']}" if healing.get("summary") else ""))
    view = body.get("pipeline")
    # Without a cluster view (a single node, a peer, a replica) its drains come here.
    links = ((pipeline(view) if view else stage_links(workers)) + replica_links(workers)
             + ([] if view else drain_lines(body.get("drains") or [])))
    return "\n".join([*lines, "", workers_table(workers), *worker_groups(workers),
                      *loading(workers), *stage_caches(workers),
                      *stage_speculation(workers), *links, "",
                      health(body["problems"])])


def prompt_cache(stats: dict[str, Any]) -> str:
    """An engine's prompt cache (``types.PromptCacheStats``; a pipeline's, a stage's):
    ``prompt cache: 3 hits, 1 miss, 1200 tokens reused; holds 2 caches, 12.0 MiB``, and
    a stage's bound (``of 1.0 GiB``), the prefixes a stage had lost (``1 lost``)."""
    budget = stats.get("budget")
    return (f"prompt cache: {count(stats.get('hits'), 'hit', 'hits')}, "
            f"{count(stats.get('misses'), 'miss', 'misses')}, "
            f"{count(stats.get('tokens_reused'), 'token', 'tokens')} reused; holds "
            f"{count(stats.get('entries'), 'cache', 'caches')}, {size(stats.get('bytes'))}"
            + (f" of {size(budget)}" if isinstance(budget, int) else "")
            + (f"; {stats['lost']} lost by a stage (prefilled whole)" if stats.get("lost")
               else ""))


def loading(workers: list[dict[str, Any]], now: float | None = None) -> list[str]:
    """A stage or router loading its weights: ``stage: loading 43% of 61.0 GiB, 12 s``
    (or a stage fetching them first: ``stage: downloading 43% of ...``)."""
    now = time.time() if now is None else now
    return [load[2] for w in workers if (load := worker_loading(w, now)) is not None]


def worker_loading(w: dict[str, Any], now: float) -> tuple[int, int, str, str] | None:
    """A worker's load (its stats' ``loading``): bytes read, bytes to read, its line
    ``router: loading 43% of 61.0 GiB, 12 s`` and its step (``downloading`` a repo id's
    weights first, then ``loading``); None when it says none."""
    load = load_progress((w.get("stats") or {}).get("loading"))
    if load is None:
        return None
    return (load["done"], load["total"], f"{w['name']}: " + loading_text(load, now),
            load.get("step", "loading"))


def pipeline(view: dict[str, Any], now: float | None = None) -> list[str]:
    """The coordinator's cluster view (``mlxctl.status/1``'s ``pipeline``): the plan, the
    router and its throughput, each stage's node, layers, link and peer, the drains and a
    secret rotation."""
    now = time.time() if now is None else now
    plan = (f"plan {view['epoch']} ({view['state']})" if view.get("epoch") is not None
            else f"no plan yet ({view['state']})" if view.get("state")
            else "a written cluster config")
    head = [plan] + ([f"model {view['model']}"] if view.get("model") else [])
    r = view.get("router")
    if r:
        rate = r.get("tokens_per_s")
        serving = (f"router {r.get('url') or '-'} ({r['state']}) · "
                   + (f"{rate:.1f} tokens/s (the pipeline's, last 10 s)" if rate is not None
                      else "tokens/s not measured yet"))
    else:
        serving = "router not started"
    stages = view["stages"]
    attached = sum(1 for s in stages if (s.get("link") or {}).get("state") == "attached")
    rows, colors, errors = [], [], []
    for s in stages:
        link, peer = s.get("link") or {}, s.get("peer") or {}
        lasted = duration(now - link["since"]) if link.get("since") else "-"
        rtt = f"{link['rtt_ms']:.1f} ms" if link.get("rtt_ms") is not None else "-"
        layers = f"[{s['layers'][0]}, {s['layers'][1]})" if s.get("layers") else "-"
        group = _group(s, stages)
        rows.append([*group, s.get("stage") or "-", s.get("node_id") or "-", layers,
                     (link.get("state") or "-").replace("_", " "), lasted, rtt,
                     link.get("address") or "-", peer.get("state") or "-",
                     since(peer.get("since"), now), peer.get("key_id") or "-",
                     _held(link.get("prompt_cache"))])
        colors.append([*_blank(group), None, None, None,
                       LINK_COLORS.get(link.get("state") or ""), None, None,
                       None, LIVENESS_COLORS.get(peer.get("state") or ""), None,
                       "red" if peer.get("key_stale") else None, None])
        if link.get("error"):
            errors.append(f"  {s.get('stage')}: {link['error']}")
        if peer.get("state") in ("suspect", "dead") and peer.get("reason"):
            errors.append(f"  {s.get('stage')} ({s.get('node_id') or s.get('address')}): "
                          f"{peer['state']}: {peer['reason']}")
    out = ["", "cluster: " + " · ".join(head), f"  {serving}"]
    if stages:
        out += [f"stages of {r['worker'] if r else 'router'}: {attached} of {len(stages)} "
                "attached", table([*_group({"replica": "REPLICA"}, stages), "STAGE", "NODE",
                                   "LAYERS", "LINK", "FOR", "RTT", "ADDRESS", "PEER",
                                   "PEER SINCE", "KEY", "CACHE"], rows, colors), *errors]
    for p in view.get("other_peers") or []:
        out.append(f"peer {p.get('node_id') or '-'} ({p['address']}, no stage): "
                   f"{p.get('state') or 'not watched'} since {since(p.get('since'), now)}, "
                   f"key {p.get('key_id') or '-'}"
                   + (" (not ours: it missed a secret rotation)" if p.get("key_stale") else ""))
    for d in view.get("drains") or []:
        out.append(drain_line(d, now))
    rot = view.get("rotation")
    if rot and rot.get("in_progress"):
        out.append(f"secret rotation {rot['id']} to key {rot['new_key_id']}: {rot['step']} "
                   f"({len(rot.get('members') or [])} member(s), since "
                   f"{since(rot.get('started_at'), now)})")
    return out


def _held(c: dict[str, Any] | None) -> str:
    """A stage's prompt cache in a cell: its bytes and entries."""
    return "-" if not c else f"{size(c['bytes'])}/{c['entries']}"


def stage_caches(workers: list[dict[str, Any]]) -> list[str]:
    """A stage worker's prompt cache (on its host's status): ``stage-1: prompt cache ...``."""
    return [f"{w['name']}: " + prompt_cache(w["stats"]["prompt_cache"]) for w in workers
            if w.get("role") == "stage" and isinstance(w.get("stats"), dict)
            and isinstance(w["stats"].get("prompt_cache"), dict)]


def _group(s: Any, stages: list[Any]) -> list[str]:
    """The REPLICA cell of a stage's row (``s``), where the router serves replica groups
    (its stages carry ``replica``); else no cell."""
    return [str(s.get("replica", "-"))] if any("replica" in t for t in stages) else []


def _blank(cells: list[str]) -> list[str | None]:
    """No colour for each of ``cells``."""
    return [None for _ in cells]


def stage_links(workers: list[dict[str, Any]]) -> list[str]:
    """A pipeline router's stages: whether each is attached, and why not (its stats)."""
    out: list[str] = []
    for w in workers:
        stages = (w.get("stats") or {}).get("stages")
        if not stages:
            continue
        now = time.time()
        rows, colors, errors = [], [], []
        for s in stages:
            lasted = duration(now - s["since"]) if s.get("since") else "-"
            group = _group(s, stages)
            rows.append([*group, s["stage"], s["address"],
                         f"[{s['layers'][0]}, {s['layers'][1]})",
                         s["state"].replace("_", " "), lasted])
            colors.append([*_blank(group), None, None, None, LINK_COLORS.get(s["state"]),
                           None])
            if s.get("error"):
                errors.append(f"  {s['stage']}: {s['error']}")
        attached = sum(1 for s in stages if s.get("connected"))
        out += ["", f"stages of {w['name']}: {attached} of {len(stages)} attached",
                table([*_group({"replica": "REPLICA"}, stages), "STAGE", "ADDRESS", "LAYERS",
                       "LINK", "FOR"], rows, colors), *errors]
    return out


def replica_links(workers: list[dict[str, Any]]) -> list[str]:
    """A router node's replicas: whether each is up, and why not (its stats)."""
    out: list[str] = []
    for w in workers:
        replicas = (w.get("stats") or {}).get("replicas")
        if not replicas:
            if (w.get("stats") or {}).get("replicas_discovered") is not None:
                out += ["", f"replicas of {w['name']}: none found by discovery yet"]
            continue
        rows, colors, errors = [], [], []
        for r in replicas:
            rows.append([r["replica"], r["agent"], r["state"], str(r.get("dispatched", 0))])
            colors.append([None, None, REPLICA_COLORS.get(r["state"]), None])
            if r.get("error") and r["state"] != "up":
                errors.append(f"  {r['replica']}: {r['error']}")
        up = sum(1 for r in replicas if r.get("connected"))
        out += ["", f"replicas of {w['name']}: {up} of {len(replicas)} up",
                table(["REPLICA", "AGENT", "STATE", "DISPATCHED"], rows, colors), *errors]
    return out


def health(problems: list[dict[str, Any]]) -> str:
    if not problems:
        return "health: " + paint("ok", "green")
    lines = ["health: " + paint(f"{len(problems)} problem(s)", "red")]
    for p in problems:
        lines.append(f"  {paint('x', 'red')} {p['message']}")
        lines.append(f"    next: {p['next']}")
    return "\n".join(lines)


def event_line(e: dict[str, Any]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"]))
    return f"{stamp}  #{e['id']:<5} {e['kind']:<24} {e['message']}"


def cluster_plan(body: dict[str, Any]) -> str:
    lines = [str(body["table"])]
    for note in body.get("notes") or []:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def peer_step(p: dict[str, Any]) -> str:
    """One peer's step in a bring-up (``mlxctl cluster activate``)."""
    color = {"active": "green", "failed": "red", "aborted": "yellow", "deactivated": "green",
             "unreachable": "red", "refused": "red"}.get(p["state"])
    what = paint(p["state"], color) + (f": {p['reason']}" if p.get("reason") else "")
    layers = f"layers [{p['layers'][0]}, {p['layers'][1]})" if p.get("layers") else ""
    return f"  {p.get('stage') or '-':8} {p['address']:22} {layers:16} {what}"


def peer_loading(p: dict[str, Any]) -> tuple[int, str] | None:
    """A loading peer's progress in a bring-up (its row's ``loading``): its percentage and
    the line ``mlxctl cluster activate`` prints; None when it has not said."""
    load = p.get("loading")
    if p.get("state") != "loading" or not isinstance(load, dict):
        return None
    try:
        done, total, elapsed = int(load["done"]), int(load["total"]), float(load["elapsed_s"])
    except (KeyError, TypeError, ValueError):
        return None
    text = loading_text(LoadProgress(done=done, total=total, since=0.0,
                                     step=str(load.get("step") or "loading")), elapsed)
    pct = 100 * done // total if total > 0 else 0
    return pct, peer_step({**p, "state": text, "reason": ""})
