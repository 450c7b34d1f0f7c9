"""Each worker's own metrics, from the stats it answered (its control channel's ``stats``
op, as ``mlxctl status`` reads them); no IO here.

Read by what the stats hold, not by role, since a prefill or decode node's worker is a
``router`` without an OpenAI port: a pipeline stage's (``workers/stage.py``: ``stage``,
``steps``, ...; a last stage's ``speculative`` counters), a prefill or decode node's
(``workers/handoff_node.py``: ``handoffs``), a tensor rank's (``workers/tensor_rank.py``:
``tensor``; a tensor stage's follower's ``tensor.prompt_cache``: the entries and bytes it
holds of rank 0's), and a prompt cache where one says so (``prompt_cache``). A router with an
OpenAI port (its stats carry ``url``) serves its engine's metrics there
(``api/edge/metrics.py``); here it has only the daemon's lines.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import Metric

from mlxceld.observe.catalog import new
from mlxceld.types import JSON

# A stage's counters and gauges: (family, its stats key)
_STAGE = (("mlxceld_stage_steps", "steps"), ("mlxceld_stage_tokens", "tokens"),
          ("mlxceld_stage_refused", "refused"), ("mlxceld_stage_compute_seconds", "compute_s"),
          ("mlxceld_stage_sequences", "sequences"), ("mlxceld_stage_queue_depth", "queued"))
_HELD = (("mlxceld_prompt_cache_entries", "entries"), ("mlxceld_prompt_cache_bytes", "bytes"))
_CACHE = (("mlxceld_prompt_cache_hits", "hits"), ("mlxceld_prompt_cache_misses", "misses"),
          ("mlxceld_prompt_cache_tokens_reused", "tokens_reused"), *_HELD,
          ("mlxceld_prompt_cache_budget_bytes", "budget"),
          ("mlxceld_prompt_cache_evicted", "evicted"))
_HANDOFF = (("mlxceld_kv_handoffs", "handoffs"), ("mlxceld_kv_handoff_bytes", "bytes"),
            ("mlxceld_kv_handoff_seconds", "seconds"),
            ("mlxceld_kv_handoffs_refused", "refused"),
            ("mlxceld_kv_handoffs_dropped", "dropped"))
_TENSOR = (("mlxceld_tensor_rank_steps", "steps"), ("mlxceld_tensor_rank_sequences",
                                                    "sequences"))


def worker_families(stats: Mapping[str, JSON]) -> Iterator[Metric]:
    """The families of every worker's ``stats`` (by name); each family once, with a
    sample per worker that has it."""
    families: dict[str, Any] = {}

    def add(name: str, labels: list[str], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return  # not said (yet): no sample
        if name not in families:
            families[name] = new(name)
        families[name].add_metric(labels, value)

    for worker, s in sorted(stats.items()):
        if "url" in s:
            continue  # a router with its OpenAI port: its own /metrics
        if "steps" in s and "stage" in s:
            _stage(worker, s, add)
        handoffs = s.get("handoffs")
        if isinstance(handoffs, dict):
            for name, key in _HANDOFF:
                add(name, [worker, str(s.get("node_role", ""))], handoffs.get(key))
        tensor = s.get("tensor")
        if isinstance(tensor, dict):
            for name, key in _TENSOR:
                add(name, [worker, str(tensor.get("rank", ""))], tensor.get(key))
            held = tensor.get("prompt_cache")  # a tensor stage's follower: rank 0's entries
            if isinstance(held, dict):
                for name, key in _HELD:  # its shard of each (the hits are rank 0's)
                    add(name, [worker], held.get(key))
        cache = s.get("prompt_cache")
        if isinstance(cache, dict):
            for name, key in _CACHE:
                add(name, [worker], cache.get(key))
    yield from families.values()


def _stage(worker: str, s: Mapping[str, Any], add: Any) -> None:
    layers = s.get("layers") or []
    labels = [worker, str(s["stage"]), "-".join(str(n) for n in layers)]
    for name, key in _STAGE:
        add(name, labels, s.get(key))
    add("mlxceld_stage_standby", labels, int(bool(s.get("standby"))))
    spec = s.get("speculative")  # a last stage with a draft (pipeline/speculating.py)
    if isinstance(spec, dict):
        for key in ("proposed", "accepted", "passes", "tokens", "acceptance_rate",
                    "tokens_per_pass", "drafted_ahead"):
            add(f"mlxceld_stage_speculative_{key}", labels, spec.get(key))
        add("mlxceld_stage_speculative_draft_wait_seconds", labels, spec.get("draft_s"))
    for link, rtt in (s.get("rtt_ms") or {}).items():
        add("mlxceld_stage_onward_rtt_seconds", [*labels, str(link)],
            None if rtt is None else rtt / 1000)
