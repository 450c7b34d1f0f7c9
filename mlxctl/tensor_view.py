"""``mlxctl status``'s lines for a tensor-parallel group across hosts (the daemon's
``tensor``: ``mlxceld/daemon/tensor_peers.py`` on rank 0, ``tensor_rank.py`` on a rank
host)."""

from __future__ import annotations

from typing import Any


def tensor_lines(tensor: dict[str, Any] | None) -> list[str]:
    """Rank 0: the group's state, then one line per rank (its host's agent, ring address,
    state and last error); a rank host: its rank and rank 0's ring address."""
    if not tensor:
        return []
    if tensor.get("role") != "rank0":
        if tensor.get("rank") is None:
            return ["tensor rank host: waiting for rank 0's daemon to ask it to join"]
        worker = tensor.get("worker") or f"tp-{tensor['rank']}"
        return [f"tensor rank {tensor['rank']} of {tensor['size']}{_of_stage(tensor)}: ring "
                f"{tensor['ring']}, rank 0 at {tensor['rank0']}, worker {worker} "
                f"{tensor['state']}"]
    head = (f"tensor group of {tensor['size']} ranks across hosts{_of_stage(tensor)}: "
            f"{tensor['state']}")
    lines = [head + (f" ({tensor['why']})" if tensor.get("why") else "")]
    if tensor.get("transport"):  # chosen at the last formation (engine/transport.py)
        t = tensor["transport"]
        lines.append(f"  transport: {t['backend']} ({t['reason']})")
    for r in tensor["ranks"]:  # rank 0's worker: the router, or a pipeline stage's worker
        lines.append(f"  rank {r['rank']}  {r['agent'] or '-'}  ring {r['ring'] or '-'}  "
                     f"{r['state']}" + (f": {r['error']}" if r.get("error") else ""))
    return lines


def _of_stage(tensor: dict[str, Any]) -> str:
    """" of stage stage-0 (layers [0, 2))" for a pipeline stage's group, else ""."""
    stage = tensor.get("stage")
    if not stage:
        return ""
    start, end = stage["layers"]
    return f" of stage {stage['node_id']} (layers [{start}, {end}))"
