"""What is unhealthy about a set of workers, each with a reason and a next command."""

from __future__ import annotations

import time

from mlxceld.types import JSON, WorkerState

DOWN = frozenset({WorkerState.FAILED, WorkerState.BACKOFF, WorkerState.EXITED})


def problems(workers: list[JSON]) -> list[JSON]:
    """``workers`` as ``Supervisor.snapshot`` gives them, written (``WorkerView.to_json``)."""
    out: list[JSON] = []
    for w in workers:
        name, state = w["name"], WorkerState(w["state"])
        logs = f"mlxctl logs {name}"
        if w.get("group") and state in DOWN:
            out.append(_group_member(w, state))
        elif state is WorkerState.FAILED:
            out.append(_problem(name, f"worker {name} failed: {w['reason']}",
                                f"{logs}; then: mlxctl restart {name}"))
        elif state is WorkerState.BACKOFF:
            out.append(_problem(name, f"worker {name} is restarting: {w['reason']}", logs))
        elif state is WorkerState.EXITED:
            why = w["last_exit"] or w["reason"] or "stopped"
            out.append(_problem(name, f"worker {name} is not running ({why})",
                                f"mlxctl restart {name}"))
        elif state is WorkerState.RUNNING and w.get("healthy") is False:
            out.append(_problem(name, f"worker {name} does not answer health probes: "
                                f"{w['reason']}", logs))
        out += _stage_links(w)
        out += _replica_links(w)
    return out


def _group_member(w: JSON, state: WorkerState) -> JSON:
    """A member of a worker group (a tensor-parallel rank: ``supervisor/groups.py``) that
    is not running: the group serves nothing without it; what happens next."""
    name, group = w["name"], w["group"]
    tail = name.rsplit("-", 1)[-1]
    rank = int(tail) if w["role"] == "tp" and tail.isdigit() else 0
    who = (f"worker {name} (rank {rank} of tensor group {group})"
           if w["role"] in ("tp", "router") else f"worker {name} (group {group})")
    logs = f"mlxctl logs {name}"
    if state is WorkerState.BACKOFF:
        return _problem(name, f"{who} is restarting: {w['reason']}; the group serves once "
                        "every rank runs again (its members restart together)", logs)
    if state is WorkerState.FAILED:
        return _problem(name, f"{who} failed: {w['reason']}; the group is stopped with it",
                        f"{logs}; then: mlxctl restart {name} (restarts the whole group)")
    why = w["last_exit"] or w["reason"] or "stopped"
    return _problem(name, f"{who} is not running ({why}); the group serves nothing without "
                    "it", f"mlxctl restart {name} (restarts the whole group)")


def _replica_links(w: JSON) -> list[JSON]:
    """A router node's replicas that are down (from its stats, when asked); one finding
    them by discovery that has found none yet."""
    stats = w.get("stats") or {}
    if stats.get("replicas_discovered") is not None and not stats.get("replicas"):
        return [_problem(w["name"], f"worker {w['name']} has found no replica by discovery "
                         "yet: no peer of this daemon says it is a hybrid node serving "
                         "the router's model",
                         "mlxctl cluster nodes (are the replicas' agents there, reachable?); "
                         "on each replica: mlxctl status (same model files, same cluster "
                         f"secret, node role hybrid); mlxctl logs {w['name']}")]
    return [_problem(r["replica"], f"worker {w['name']} cannot use replica {r['replica']} "
                     f"(agent {r['agent']}): {r['error']}",
                     f"on the replica's host (agent {r['agent']}): mlxctl status; it is used "
                     f"again by itself once it serves; mlxctl logs {w['name']}")
            for r in (w.get("stats") or {}).get("replicas") or [] if r.get("state") == "down"]


def _stage_links(w: JSON) -> list[JSON]:
    """A pipeline router's stages that are not attached (from its stats, when asked)."""
    stages = (w.get("stats") or {}).get("stages") or []
    return [_stage_link(w["name"], s) for s in stages
            if not s.get("connected") and s.get("state") != "connecting"]


def _stage_link(router: str, s: JSON) -> JSON:
    state = s["state"]
    since = (" since " + time.strftime("%H:%M:%S", time.localtime(s["since"]))
             if s.get("since") else "")
    message = (f"worker {router} cannot reach stage {s['stage']} ({state.replace('_', ' ')})"
               f"{since}: {s['error']}")
    if state == "failed":  # its host's stand-in said so: the node, the reason
        return _problem(s["stage"], f"worker {router} reads stage {s['stage']} failed"
                        f"{since}: {s['error']}",
                        f"on the stage's host ({s['address']}): mlxctl status and mlxctl "
                        "logs stage, fix what they name, then mlxctl restart stage there; "
                        "this router attaches it again by itself once it serves")
    if state == "silent":
        return _problem(s["stage"], message,
                        f"check that the host of stage {s['stage']} ({s['address']}) is awake "
                        "and on the network; it is re-attached by itself once it answers; "
                        f"mlxctl logs {router}")
    return _problem(s["stage"], message, f"mlxctl status on the stage's host "
                    f"({s['address']}); mlxctl logs {router}")


def _problem(subject: str, message: str, next_command: str) -> JSON:
    return {"subject": subject, "message": message, "next": next_command}
