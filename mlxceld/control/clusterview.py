"""The coordinator's cluster view in `mlxctl status` (``pipeline`` in ``GET /v1/status``).

Pure: built from what the daemon already keeps when the status is asked, never from a
new remote call, so a silent peer cannot slow the status down. Its sources:

- the plan: the bring-up's state (``bringup``: epoch, model, each peer's stage, node id,
  agent address, layers and assignment state; ``cluster/coordinator.py``);
- the links: the router worker's stats (``stages``: each link's state, since when, the
  heartbeat's round trip; ``tokens`` and ``tokens_per_s``: the pipeline's throughput as
  the router hands tokens to its clients, ``pipeline/throughput.py``), refreshed every
  second by the router and asked within ``supervisor.STATS_TIMEOUT_S``;
- the peers: the failure detector's rows and each candidate's primary key id
  (``GET /v1/cluster/nodes``: ``key_stale`` when it is not ours), for the plan's peers
  in their stage's row, for the others (spares, hosts of an older plan) in
  ``other_peers``;
- the drains (``GET /v1/drains``), self-healing (``healing``) and the latest secret
  rotation (``GET /v1/secrets``'s ``rotation``).

Its shape is ``types.PipelineView`` (``mlxctl.status/1``, documented in mlxctl(1));
``problems`` adds to the health footer what only this view sees: a peer left on another
key (but while a rotation runs, when primaries differ for a while), a secret rotation
that failed.
"""

from __future__ import annotations

from typing import Any

from mlxceld.types import (
    JSON,
    ClusterPeer,
    PeerView,
    PipelineRouter,
    PipelineStage,
    PipelineView,
    StageLinkView,
)


def serves_pipeline(status: JSON) -> bool:
    """Whether ``status`` is a coordinator's (a bring-up, not deactivated) or a router's
    over stages: the daemons that have a view (``pipeline_view``)."""
    bringup = status.get("bringup") or {}
    return bringup.get("state") not in (None, "deactivated") or any(
        (w.get("stats") or {}).get("stages") for w in status.get("workers") or []
        if w.get("role") == "router")


def pipeline_view(status: JSON, nodes: JSON, drains: list[JSON],
                  rotation: JSON | None) -> PipelineView | None:
    """The view, or None on a daemon that serves no pipeline (no bring-up, no router over
    stages): a peer, a single host. ``status``: ``GET /v1/status``'s body with the
    workers' stats; ``nodes``: ``GET /v1/cluster/nodes``'s."""
    bringup: JSON = status.get("bringup") or {}
    router = next((w for w in status.get("workers") or [] if w.get("role") == "router"), None)
    stats: JSON = (router or {}).get("stats") or {}
    links: list[JSON] = stats.get("stages") or []
    if not bringup and not links:
        return None
    peers: list[JSON] = bringup.get("peers") or []
    names = [p.get("stage") for p in peers] + [
        s["stage"] for s in links if s["stage"] not in {p.get("stage") for p in peers}]
    by_link = {s["stage"]: s for s in links}
    by_peer = {p.get("stage"): p for p in peers}
    members = _members(nodes)
    by_drain = {d["node_id"]: d for d in drains}
    stages: list[PipelineStage] = []
    for rank, name in enumerate(names):
        peer = by_peer.get(name) or {}
        address = peer.get("address")
        node = peer.get("node_id")
        link = by_link.get(name) or {}
        row: PipelineStage = {
            "stage": name, "rank": rank, "node_id": node, "address": address,
            "layers": peer.get("layers") or (by_link.get(name) or {}).get("layers"),
            "assignment": peer.get("state"),
            "link": _link(by_link.get(name)),
            "peer": members.get(address) if address else None,
            "drain": by_drain.get(node or "") or by_drain.get(name or ""),
        }
        if "replica" in link:  # a router over replica groups (replicas/groups.py)
            row["replica"] = link["replica"]
        stages.append(row)
    serving = status.get("serving") or {}
    in_plan = {s["address"] for s in stages if s["address"]}
    ids = {**{r["address"]: r.get("node_id") for r in nodes.get("liveness") or []},
           **{n["address"]: n.get("node_id") for n in nodes.get("nodes") or []
              if n.get("node_id")}}
    others: list[ClusterPeer] = [{"address": a, "node_id": ids.get(a), **m}
                                 for a, m in members.items() if a not in in_plan]
    return {
        "epoch": bringup.get("epoch"), "model": bringup.get("model"),
        "state": bringup.get("state"),
        "router": _router(router, stats, serving) if router else None,
        "stages": stages, "other_peers": others, "key_id": nodes.get("key_id"),
        "drains": drains,
        "healing": status.get("healing"),
        "rotation": None if rotation is None else {
            **rotation, "in_progress": rotation.get("step") not in ("done", "failed")},
    }


def _link(s: JSON | None) -> StageLinkView | None:
    if s is None:
        return None
    return {"state": s["state"], "since": s.get("since"), "address": s.get("address"),
            "rtt_ms": s.get("rtt_ms"), "error": s.get("error"),
            "prompt_cache": s.get("prompt_cache")}


def _router(w: JSON, stats: JSON, serving: JSON) -> PipelineRouter:
    return {"worker": w["name"], "state": w["state"],
            "url": stats.get("url") or serving.get("url"),
            "tokens": stats.get("tokens"), "tokens_per_s": stats.get("tokens_per_s"),
            "throughput_of": "pipeline"}


def _members(nodes: JSON) -> dict[str, PeerView]:
    """Each peer by agent address: its failure-detector row and its primary key id."""
    out: dict[str, PeerView] = {}
    rows: dict[str, Any] = {r["address"]: r for r in nodes.get("liveness") or []}
    for n in nodes.get("nodes") or []:
        if n.get("liveness"):
            rows.setdefault(n["address"], n["liveness"])
    keys = {n["address"]: n for n in nodes.get("nodes") or []}
    for address in sorted({*rows, *keys}):
        live = rows.get(address) or {}
        cand = keys.get(address) or {}
        out[address] = {"state": live.get("state"), "since": live.get("since"),
                        "reason": live.get("reason"), "last_answer": live.get("last_answer"),
                        "key_id": cand.get("key_id"), "key_stale": bool(cand.get("key_stale"))}
    return out


def problems(view: PipelineView | None) -> list[JSON]:
    """What only this view sees, each with a reason and the next command: a plan's peer
    that dials with another primary key (it missed a rotation), a rotation that failed."""
    if view is None:
        return []
    out: list[JSON] = []
    rotating = bool(view["rotation"] and view["rotation"].get("in_progress"))
    stale = [] if rotating else [  # mid-rotation, primaries differ for a while: no problem
        (s["node_id"] or s["address"] or s["stage"], s["stage"], s["peer"])
        for s in view["stages"]]
    stale += [] if rotating else [(p["node_id"] or p["address"], "no stage", p)
                                  for p in view["other_peers"]]
    for who, where, peer in stale:
        if peer is None or not peer["key_stale"]:
            continue
        out.append({
            "subject": who,
            "message": f"node {who} ({where}) dials with key {peer['key_id']}, this "
            f"coordinator with {view['key_id']}: it missed a secret rotation, and its traffic "
            "fails once the old key is removed",
            "next": f"on node {who}: mlxctl secret install FILE --primary with this cluster's "
            "secret; mlxctl cluster nodes shows its key"})
    r = view["rotation"]
    if r is not None and r.get("step") == "failed":
        failed = "; ".join(f"member {m} failed {why}" for m, why in
                           (r.get("failures") or {}).items()) or "no member named"
        out.append({
            "subject": "rotation",
            "message": f"secret rotation {r['id']} to key {r['new_key_id']} failed: {failed}",
            "next": "bring those members back (mlxctl cluster nodes), then run mlxctl "
            "secret rotate again"})
    return out


def name_nodes(found: list[JSON], view: PipelineView | None) -> list[JSON]:
    """``found`` with each problem about a stage (its subject the stage's id, as the router's
    link problems have it) saying which node runs that stage, where the plan knows it."""
    if view is None:
        return found
    hosts = {s["stage"]: s for s in view["stages"] if s["stage"] and s["node_id"]}
    out = []
    for p in found:
        s = hosts.get(str(p.get("subject")))
        out.append(p if s is None else {
            **p, "message": f"{p['message']} (stage {s['stage']} runs on node "
            f"{s['node_id']}, agent {s['address']})"})
    return out
