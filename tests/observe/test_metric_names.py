"""Every metric name people are shown is one we serve: the Grafana dashboard's queries
(contrib/grafana/mlxceld.json) and mlxceld(8)'s METRICS section, against the names the
code serves: the daemon's (``observe/catalog.py``) and the router's (``api/edge/metrics.py``,
read from a real ``Metrics`` with stage links, a prompt cache and continuity counts)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlxceld.api.edge.metrics import Metrics
from mlxceld.engine.continuation import Continuity
from mlxceld.engine.speculative import SpeculationStats
from mlxceld.observe.catalog import FAMILIES, PROCESS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "contrib" / "grafana" / "mlxceld.json"
MAN = ROOT / "man" / "mlxceld.8"
NAME = re.compile(r"\b((?:mlxceld|process)_[a-z0-9_]+)\b")
SAMPLES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def router_names() -> set[str]:
    link = {"stage": "s", "layers": [0, 1], "state": "attached", "rtt_ms": 1.0,
            "prompt_cache": {"bytes": 1, "entries": 1}}
    cache = {"hits": 1, "misses": 1, "tokens_reused": 1, "entries": 1, "bytes": 1}
    metrics = Metrics(queue_depth=lambda: 0, active_sequences=lambda: 0, model_id="m",
                      context_length=8, stage_links=lambda: [link],
                      prompt_caches=lambda: [({}, cache)],  # type: ignore[list-item]
                      continuity=Continuity,
                      speculation=SpeculationStats().to_json)
    return {family.name + suffix for family in metrics.registry.collect()
            for suffix in SAMPLES[family.type]}


def served() -> set[str]:
    return {f.exported for f in FAMILIES} | router_names() | set(PROCESS)


def queries(node: Any) -> Iterator[str]:
    """Every PromQL text in the dashboard: panels' ``expr``, variables' queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition", "query") and isinstance(value, str):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def test_the_dashboard_queries_only_names_we_serve() -> None:
    texts = list(queries(json.loads(DASHBOARD.read_text())))
    used = {name for text in texts for name in NAME.findall(text)}
    assert len(texts) > 30 and len(used) > 25, (len(texts), used)
    assert used <= served(), sorted(used - served())


def test_the_dashboard_shows_the_router_the_stages_and_the_daemons() -> None:
    used = {name for text in queries(json.loads(DASHBOARD.read_text()))
            for name in NAME.findall(text)}
    for name in ("mlxceld_http_requests_total", "mlxceld_time_to_first_token_seconds_bucket",
                 "mlxceld_completion_tokens_total", "mlxceld_queue_depth",
                 "mlxceld_stage_steps_total", "mlxceld_stage_onward_rtt_seconds",
                 "mlxceld_prompt_cache_hits_total", "mlxceld_worker_up",
                 "mlxceld_worker_restarts_total", "mlxceld_peer_alive"):
        assert name in used, name


def test_the_man_page_lists_every_name_we_serve_and_no_other() -> None:
    text = MAN.read_text()
    section = text.split('.SH METRICS\n', 1)[1].split("\n.SH ", 1)[0].replace("\\-", "-")
    listed = set(NAME.findall(section))
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for n in served()}  # a histogram's
    assert names - listed == set(), sorted(names - listed)
    assert listed - names == set(), sorted(listed - names)
