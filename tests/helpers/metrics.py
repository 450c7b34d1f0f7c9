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


# A sample's name after its family's (prometheus-client names a counter's family with its
# ``_total``, and writes a ``_created`` of its own as a gauge family).
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count")}


def check_exposition(text: str) -> Samples:
    """``parse_samples``, and stricter than prometheus-client's parser: every family has
    one ``# HELP`` and one ``# TYPE`` line before its samples, every sample belongs to the
    family declared last, and no sample (name and labels) comes twice."""
    declared: dict[str, str] = {}
    helped: set[str] = set()
    seen: set[str] = set()
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helped, f"two HELP lines for {name}"
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in declared, f"two TYPE lines for {name}"
            assert name in helped, f"TYPE before HELP for {name}"
            declared[name], current = kind, name
        elif line.strip():
            assert not line.startswith("#"), line
            assert current is not None, f"a sample before any TYPE: {line}"
            name = line.split("{", 1)[0].split(" ", 1)[0]
            assert any(name == current + s for s in SUFFIXES[declared[current]]), (
                f"sample {name} is not of family {current} ({declared[current]})")
            key = line.rsplit(" ", 1)[0]
            assert key not in seen, f"a sample twice: {line}"
            seen.add(key)
    return parse_samples(text)


def scrape_checked(url: str, key: str | None = None) -> Samples:
    """``GET url`` (a ``/metrics`` URL), checked by ``check_exposition``."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.get(url, headers=headers, timeout=30)
    answer.raise_for_status()
    assert answer.headers["content-type"].startswith("text/plain"), answer.headers
    return check_exposition(answer.text)
