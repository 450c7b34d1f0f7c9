"""``mlxctl status``'s lines for the router's engine beyond its prompt cache: speculative
decoding's counters (the router worker's ``speculative`` stats:
``mlxceld/engine/speculative.py``; a pipeline's last stage's: ``pipeline/speculating.py``),
and the counted words both say things with."""

from __future__ import annotations

from typing import Any


def count(n: Any, one: str, many: str) -> str:
    """``1 hit``, ``3 hits``."""
    return f"{n} {one if n == 1 else many}"


def speculation_lines(stats: Any) -> list[str]:
    """``speculative decoding: 120 of 160 draft tokens accepted (75%), 40 passes, 3.9
    tokens a pass`` (a last stage's: ``, 31 drafted ahead``); nothing without a draft."""
    if not isinstance(stats, dict):
        return []
    rate, per = stats.get("acceptance_rate") or 0.0, stats.get("tokens_per_pass") or 0.0
    ahead = stats.get("drafted_ahead")  # a last stage's (pipeline/speculating.py)
    return [f"speculative decoding: {stats.get('accepted')} of "
            f"{count(stats.get('proposed'), 'draft token', 'draft tokens')} accepted "
            f"({rate:.0%}), {count(stats.get('passes'), 'pass', 'passes')}, "
            f"{per:.1f} tokens a pass"
            + (f", {ahead} drafted ahead" if isinstance(ahead, int) else "")]


def stage_speculation(workers: list[dict[str, Any]]) -> list[str]:
    """A last stage's speculative decoding (its draft's counters, on its host's status):
    ``stage: speculative decoding: ...``."""
    return [f"{w['name']}: {line}" for w in workers
            if w.get("role") == "stage" and isinstance(w.get("stats"), dict)
            for line in speculation_lines(w["stats"].get("speculative"))]
