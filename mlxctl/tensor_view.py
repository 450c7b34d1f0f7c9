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
        return [f"tensor rank {tensor['rank']} of {tensor['size']}: ring {tensor['ring']}, "
                f"rank 0 at {tensor['rank0']}, worker tp-{tensor['rank']} {tensor['state']}"]
    head = f"tensor group of {tensor['size']} ranks across hosts: {tensor['state']}"
    lines = [head + (f" ({tensor['why']})" if tensor.get("why") else "")]
    if tensor.get("transport"):  # chosen at the last formation (engine/transport.py)
        t = tensor["transport"]
        lines.append(f"  transport: {t['backend']} ({t['reason']})")
    for r in tensor["ranks"]:
        lines.append(f"  rank {r['rank']}  {r['agent'] or '-'}  ring {r['ring'] or '-'}  "
                     f"{r['state']}" + (f": {r['error']}" if r.get("error") else ""))
    return lines
