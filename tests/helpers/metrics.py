"""A router's ``GET /metrics`` read back: Prometheus text parsed by prometheus-client."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_samples(text: str) -> Samples:
    """Every sample as ``{(name, labels): value}``; fails on text that is not the format."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(base: str, key: str | None = None) -> Samples:
    """``base`` is the port's root or its ``/v1`` URL."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.get(base.removesuffix("/v1") + "/metrics", headers=headers, timeout=10)
    answer.raise_for_status()
    return parse_samples(answer.text)


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))
