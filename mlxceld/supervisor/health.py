"""What is unhealthy about a set of workers, each with a reason and a next command."""

from __future__ import annotations

from mlxceld.types import JSON, WorkerState


def problems(workers: list[JSON]) -> list[JSON]:
    """``workers`` as ``Supervisor.snapshot`` gives them."""
    out: list[JSON] = []
    for w in workers:
        name, state = w["name"], WorkerState(w["state"])
        logs = f"mlxctl logs {name}"
        if state is WorkerState.FAILED:
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
    return out


def _stage_links(w: JSON) -> list[JSON]:
    """A pipeline router's stages that are not attached (from its stats, when asked)."""
    stages = (w.get("stats") or {}).get("stages") or []
    return [_problem(s["stage"], f"worker {w['name']} cannot reach stage {s['stage']} "
                     f"({s['state'].replace('_', ' ')}): {s['error']}",
                     f"mlxctl status on the stage's host ({s['address']}); "
                     f"mlxctl logs {w['name']}")
            for s in stages if not s.get("connected") and s.get("state") != "connecting"]


def _problem(subject: str, message: str, next_command: str) -> JSON:
    return {"subject": subject, "message": message, "next": next_command}
