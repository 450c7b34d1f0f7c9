"""``/metrics``' per-scrape part (``api/edge/metrics.py`` ``Snapshot``), in process: the process,
the build, the model, stage links fed through the app's ``stage_links`` seam and prompt
caches through its ``prompt_caches``, requests continued elsewhere through its
``continuity``."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psutil

from mlxceld.api.edge.metrics import LINK_STATES
from mlxceld.engine.continuation import Continuity

from helpers.api import http_client, make_app
from helpers.metrics import Samples, parse_samples, sample

LINKS: list[dict[str, Any]] = [
    {"stage": "stage-0", "layers": [0, 2], "state": "attached", "rtt_ms": 1.5,
     "prompt_cache": {"bytes": 65536, "entries": 3, "budget": 1 << 30}},
    {"stage": "stage-1", "layers": [2, 4], "state": "silent", "rtt_ms": None,
     "prompt_cache": None},
]


def scrape_app(**options: Any) -> Samples:
    async def main() -> str:
        async with http_client(make_app(**options)) as client:
            return (await client.get("/metrics")).text

    return parse_samples(asyncio.run(main()))


def test_the_process_build_and_model_without_links() -> None:
    metrics = scrape_app()
    me = psutil.Process(os.getpid())
    assert sample(metrics, "process_start_time_seconds") == me.create_time()
    assert (sample(metrics, "process_resident_memory_bytes") or 0) > 1 << 20
    assert sample(metrics, "mlxceld_model_info", model="fake-model", context_length="256") == 1
    assert not [n for n, _ in metrics if n.startswith(("mlxceld_stage_link",
                                                        "mlxceld_prompt_cache"))]


def test_each_link_has_one_gauge_per_state_and_its_rtt_when_known() -> None:
    metrics = scrape_app(stage_links=lambda: LINKS)
    states = {dict(labels)["state"]: value for name, labels in metrics
              if name == "mlxceld_stage_link_state" and ("stage", "stage-1") in labels
              for value in [metrics[(name, labels)]]}
    assert set(states) == set(LINK_STATES) and states["silent"] == 1
    assert sum(states.values()) == 1
    assert sample(metrics, "mlxceld_stage_link_state", stage="stage-0", layers="0-2",
                  state="attached") == 1
    assert sample(metrics, "mlxceld_stage_link_rtt_seconds", stage="stage-0",
                  layers="0-2") == 0.0015
    assert sample(metrics, "mlxceld_stage_link_rtt_seconds", stage="stage-1",
                  layers="2-4") is None


def test_each_stage_says_what_its_prompt_cache_holds() -> None:
    metrics = scrape_app(stage_links=lambda: LINKS)
    assert sample(metrics, "mlxceld_stage_prompt_cache_bytes", stage="stage-0",
                  layers="0-2") == 65536
    assert sample(metrics, "mlxceld_stage_prompt_cache_entries", stage="stage-0",
                  layers="0-2") == 3
    assert sample(metrics, "mlxceld_stage_prompt_cache_bytes", stage="stage-1",
                  layers="2-4") is None  # not said (or no prompt cache)


def test_a_prompt_cache_has_its_counters_and_gauges_with_its_labels() -> None:
    stats = {"hits": 3, "misses": 1, "tokens_reused": 1200, "entries": 2, "bytes": 4096}
    metrics = scrape_app(prompt_caches=lambda: [({}, stats)])  # the local engine's
    assert [sample(metrics, f"mlxceld_prompt_cache_{name}") for name in (
        "hits_total", "misses_total", "tokens_reused_total", "entries", "bytes")] == \
        [3, 1, 1200, 2, 4096]
    # room for labels: each cache of several (a pipeline's stages) by its own
    other = {**stats, "hits": 5}
    metrics = scrape_app(prompt_caches=lambda: [({"stage": "stage-0"}, stats),
                                                ({"stage": "stage-1"}, other)])
    assert sample(metrics, "mlxceld_prompt_cache_hits_total", stage="stage-1") == 5
    assert sample(metrics, "mlxceld_prompt_cache_bytes", stage="stage-0") == 4096


def test_an_engine_that_continues_requests_shows_its_counts() -> None:
    counts = Continuity(held=2, held_total=5, replayed_total=3, lost_total=1,
                        continued_total=4)
    metrics = scrape_app(continuity=lambda: counts)
    assert sample(metrics, "mlxceld_sequences_held_now") == 2
    assert sample(metrics, "mlxceld_sequences_held_total") == 5
    assert sample(metrics, "mlxceld_sequences_replayed_total") == 3
    assert sample(metrics, "mlxceld_sequences_lost_total") == 1
    assert sample(metrics, "mlxceld_sequences_continued_total") == 4
    assert not [n for n, _ in scrape_app() if n.startswith("mlxceld_sequences_")]
