"""What is unhealthy about a set of workers, each with a reason and a next command."""

from __future__ import annotations

from mlxceld.types import JSON


def problems(workers: list[JSON]) -> list[JSON]:
    out: list[JSON] = []
    for w in workers:
        name, state = w["name"], w["state"]
        logs = f"mlxctl logs {name}"
        if state == "failed":
            out.append(_problem(name, f"worker {name} failed: {w['reason']}",
                                f"{logs}; then: mlxctl restart {name}"))
        elif state == "backoff":
            out.append(_problem(name, f"worker {name} is restarting: {w['reason']}", logs))
        elif state == "exited":
            why = w["last_exit"] or w["reason"] or "stopped"
            out.append(_problem(name, f"worker {name} is not running ({why})",
                                f"mlxctl restart {name}"))
        elif state == "running" and w.get("healthy") is False:
            out.append(_problem(name, f"worker {name} does not answer health probes: "
                                f"{w['reason']}", logs))
    return out


def _problem(subject: str, message: str, next_command: str) -> JSON:
    return {"subject": subject, "message": message, "next": next_command}
