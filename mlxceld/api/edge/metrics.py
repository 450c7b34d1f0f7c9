"""Prometheus metrics of one router app, in a registry of its own (``GET /metrics``).

A registry per app, not prometheus-client's global one: two apps in one
process (tests, a worker serving two models) keep separate counts.

Besides the requests' own counts, each scrape reads (``Snapshot``):

- the process, from psutil (prometheus-client's own reads Linux's /proc only):
  ``process_resident_memory_bytes``, ``process_cpu_seconds_total`` (user and system),
  ``process_open_fds``, ``process_start_time_seconds`` (Unix time);
- ``mlxceld_build_info{version, python, mlx, mlx_lm} 1`` (a package not installed
  reads "none");
- ``mlxceld_model_info{model, context_length} 1``: the model served, by its id, and the
  context it is served with (``[serve] context_length`` caps the model's);
- an engine's prompt (prefix) cache (``engine/prompt_cache.py``), each with the labels
  its reading names (none for the local engine's): ``mlxceld_prompt_cache_hits_total``
  and ``mlxceld_prompt_cache_misses_total`` (lookups that reused a prefix, or none),
  ``mlxceld_prompt_cache_tokens_reused_total`` (prompt tokens not prefilled again),
  ``mlxceld_prompt_cache_entries`` and ``mlxceld_prompt_cache_bytes`` (held now); left
  out where the engine keeps none here (a pipeline's or a replica pool's router);
- over a pipeline, for each stage link (labels ``stage``: its node id, ``layers``:
  ``START-END``): ``mlxceld_stage_link_state{stage, layers, state}``, 1 for the state
  it is in and 0 for every other (``pipeline/connectivity.py``'s ``LinkState``), and
  ``mlxceld_stage_link_rtt_seconds{stage, layers}``: the round trip of its latest
  heartbeat ping answered (``net/liveness.py``; left out before one is, or while the
  link is not attached);
- with a draft model (``engine/speculative.py``): ``mlxceld_speculative_proposed_total``
  and ``mlxceld_speculative_accepted_total`` (draft tokens proposed, and accepted by the
  model), ``mlxceld_speculative_passes_total`` and ``mlxceld_speculative_tokens_total``
  (the model's passes over proposals, and the tokens they gave), and their ratios
  ``mlxceld_speculative_acceptance_rate`` and ``mlxceld_speculative_tokens_per_pass``;
- where the router's engine continues requests elsewhere (``engine/continuation.py``'s
  ``Continuity``): ``mlxceld_sequences_held_now`` (held now for a working plan: a pipeline's
  stage lost, its heal or its stage's return awaited; ``pipeline/replay.py``),
  ``mlxceld_sequences_held_total``, ``mlxceld_sequences_replayed_total`` (replayed on a
  working plan, or on the current plan after a live move), ``mlxceld_sequences_lost_total``
  (held ones that failed: no working plan within the hold, or not replayable) and
  ``mlxceld_sequences_continued_total`` (on another replica after theirs went down
  midway; ``replicas/pool.py``).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal, get_args

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxceld import __version__
from mlxceld.engine.continuation import Continuity
from mlxceld.pipeline.connectivity import LinkState
from mlxceld.types import PromptCacheStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
OTHER_ENDPOINT = "other"
CLIENT_GONE = "499"  # nginx's "client closed request": no response was ever sent
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
LINK_STATES: tuple[str, ...] = get_args(LinkState)
StageLinks = Callable[[], Sequence[Mapping[str, Any]]]  # PipelineEngine.stages
# Each prompt cache's labels (one set of names for all) and stats: LocalEngine's, ({}, ...).
PromptCaches = Callable[[], Sequence[tuple[Mapping[str, str], PromptCacheStats]]]
Continuities = Callable[[], Continuity]  # the engine's counts of requests continued
Speculations = Callable[[], Mapping[str, float]]  # speculative.SpeculationStats.to_json
# Speculative decoding's metrics, mlxceld_speculative_KEY: (its stats' KEY, counter?, help).
_SPECULATIVE: tuple[tuple[str, bool, str], ...] = (
    ("proposed", True, "Draft tokens proposed to the model (speculative decoding)"),
    ("accepted", True, "Draft tokens the model accepted"),
    ("passes", True, "The model's passes over draft proposals"),
    ("tokens", True, "Tokens those passes gave (accepted, and one of the model's own)"),
    ("acceptance_rate", False, "Draft tokens accepted over those proposed, so far"),
    ("tokens_per_pass", False, "Tokens a pass gave, on average so far"),
)
# Continuity's counts as metrics: (its field, the metric's name, counter?, help).
_CONTINUITY: tuple[tuple[str, str, bool, str], ...] = (
    ("held", "mlxceld_sequences_held_now", False,
     "Sequences held now for a working plan (a pipeline's stage lost)"),
    ("held_total", "mlxceld_sequences_held", True,
     "Sequences held for a working plan after a stage was lost"),
    ("replayed_total", "mlxceld_sequences_replayed", True,
     "Sequences replayed on a working plan after a lost stage or a live move"),
    ("lost_total", "mlxceld_sequences_lost", True,
     "Held sequences that failed: no working plan within the hold, or not replayable"),
    ("continued_total", "mlxceld_sequences_continued", True,
     "Sequences continued on another replica after theirs went down midway"),
)
# The prompt cache's metrics, mlxceld_prompt_cache_KEY: (its stats' KEY, counter?, help).
_PROMPT_CACHE: tuple[tuple[Literal["hits", "misses", "tokens_reused", "entries", "bytes"],
                           bool, str], ...] = (
    ("hits", True, "Prompt cache lookups that reused a cached prefix"),
    ("misses", True, "Prompt cache lookups that found no prefix to reuse"),
    ("tokens_reused", True, "Prompt tokens taken from the prompt cache, not prefilled"),
    ("entries", False, "KV caches the prompt cache holds"),
    ("bytes", False, "Bytes of the KV caches the prompt cache holds"),
)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def process_metrics() -> Iterator[Metric]:
    """This process's memory, CPU time, open files and start time, read now (psutil:
    prometheus-client's own collector reads Linux's /proc only)."""
    proc = psutil.Process()
    with proc.oneshot():
        rss = proc.memory_info().rss
        cpu = proc.cpu_times()
        fds = proc.num_fds()
        started = proc.create_time()
    yield GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size",
                            value=rss)
    yield CounterMetricFamily("process_cpu_seconds", "User and system CPU time spent",
                              value=cpu.user + cpu.system)
    yield GaugeMetricFamily("process_open_fds", "Open file descriptors", value=fds)
    yield GaugeMetricFamily("process_start_time_seconds", "Start time of the process "
                            "since the Unix epoch", value=started)


def build_info(text: str) -> Metric:
    """``mlxceld_build_info{version, python, mlx, mlx_lm} 1``, with its help ``text``."""
    build = GaugeMetricFamily("mlxceld_build_info", text,
                              labels=["version", "python", "mlx", "mlx_lm"])
    build.add_metric([__version__, platform.python_version(), _version("mlx"),
                      _version("mlx-lm")], 1)
    return build


@dataclass(frozen=True)
class Snapshot(Collector):
    """What each scrape reads afresh: the process, the build, the model, the links."""

    model_id: str
    context_length: int
    stage_links: StageLinks | None = None
    prompt_caches: PromptCaches | None = None
    continuity: Continuities | None = None
    speculation: Speculations | None = None

    def collect(self) -> Iterator[Metric]:
        yield from process_metrics()
        yield build_info("The versions this router runs")
        model = GaugeMetricFamily("mlxceld_model_info", "The model served, by its id",
                                  labels=["model", "context_length"])
        model.add_metric([self.model_id, str(self.context_length)], 1)
        yield model
        if self.stage_links is not None:
            yield from self._links(self.stage_links())
        if self.prompt_caches is not None:
            yield from self._prompt_caches(self.prompt_caches())
        if self.continuity is not None:
            counts = self.continuity()
            for key, name, counter, text in _CONTINUITY:
                kind = CounterMetricFamily if counter else GaugeMetricFamily
                yield kind(name, text, value=getattr(counts, key))
        if self.speculation is not None:
            stats = self.speculation()
            for key, counter, text in _SPECULATIVE:
                kind = CounterMetricFamily if counter else GaugeMetricFamily
                yield kind(f"mlxceld_speculative_{key}", text, value=stats[key])

    @staticmethod
    def _prompt_caches(readings: Sequence[tuple[Mapping[str, str], PromptCacheStats]]
                       ) -> Iterator[Metric]:
        names = list(readings[0][0]) if readings else []
        for key, counter, text in _PROMPT_CACHE:
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            family = kind(f"mlxceld_prompt_cache_{key}", text, labels=names)
            for labels, stats in readings:
                family.add_metric([labels[n] for n in names], stats[key])
            yield family

    @staticmethod
    def _links(links: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "mlxceld_stage_link_state", "Each pipeline stage link's state: 1 for the one it "
            "is in", labels=["stage", "layers", "state"])
        rtt = GaugeMetricFamily(
            "mlxceld_stage_link_rtt_seconds", "Round trip of the latest heartbeat ping a "
            "stage answered on its attached link", labels=["stage", "layers"])
        held = GaugeMetricFamily(
            "mlxceld_stage_prompt_cache_bytes", "KV bytes each pipeline stage's prompt cache "
            "holds, as the stage last said", labels=["stage", "layers"])
        entries = GaugeMetricFamily(
            "mlxceld_stage_prompt_cache_entries", "Prefixes each pipeline stage's prompt "
            "cache holds, as the stage last said", labels=["stage", "layers"])
        for link in links:
            start, end = link["layers"]
            names = [str(link["stage"]), f"{start}-{end}"]
            for name in LINK_STATES:
                state.add_metric([*names, name], 1 if link["state"] == name else 0)
            if link.get("rtt_ms") is not None:
                rtt.add_metric(names, link["rtt_ms"] / 1000)
            if link.get("prompt_cache"):
                held.add_metric(names, link["prompt_cache"]["bytes"])
                entries.add_metric(names, link["prompt_cache"]["entries"])
        yield state
        yield rtt
        yield held
        yield entries


class Metrics:
    def __init__(self, *, queue_depth: Callable[[], float],
                 active_sequences: Callable[[], float], model_id: str = "",
                 context_length: int = 0, stage_links: StageLinks | None = None,
                 prompt_caches: PromptCaches | None = None,
                 continuity: Continuities | None = None,
                 speculation: Speculations | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(Snapshot(model_id, context_length, stage_links,
                                        prompt_caches, continuity, speculation))
        self.requests = Counter(
            "mlxceld_http_requests", "HTTP requests by endpoint and status (499: the client "
            "went away before any response)", ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter(
            "mlxceld_prompt_tokens", "Prompt tokens of the sequences admitted to the engine",
            registry=self.registry)
        self.completion_tokens = Counter(
            "mlxceld_completion_tokens", "Tokens generated by the engine (end-of-sequence "
            "tokens included)", registry=self.registry)
        self.time_to_first_token = Histogram(
            "mlxceld_time_to_first_token_seconds", "From a request's arrival (queueing "
            "included) to its first generated token", buckets=TTFT_BUCKETS,
            registry=self.registry)
        self.inter_token_latency = Histogram(
            "mlxceld_inter_token_latency_seconds", "Between two tokens of one sequence",
            buckets=ITL_BUCKETS, registry=self.registry)
        self.slow_readers_cut = Counter(
            "mlxceld_slow_readers_cut", "Sequences ended because their client stopped "
            "reading its stream (api/outbox.py)", registry=self.registry)
        queue = Gauge("mlxceld_queue_depth", "Requests waiting for a slot in the engine",
                      registry=self.registry)
        queue.set_function(queue_depth)
        active = Gauge("mlxceld_active_sequences", "Sequences admitted to the engine",
                       registry=self.registry)
        active.set_function(active_sequences)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def count_requests(app: ASGIApp, metrics: Metrics, endpoints: Collection[str], *,
                   canonical: Mapping[str, str] | None = None) -> ASGIApp:
    """Count every HTTP request by endpoint (a known path, else "other", so that
    random paths cannot grow the label set; ``canonical``: another name of a path, such
    as ``/models`` for ``/v1/models``) and by the status it was answered."""
    other_names = canonical or {}

    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        path = other_names.get(scope["path"], scope["path"])
        endpoint = path if path in endpoints else OTHER_ENDPOINT
        status = CLIENT_GONE

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await app(scope, receive, send_counted)
        except Exception:
            if status == CLIENT_GONE:
                status = "500"
            raise
        finally:
            metrics.requests.labels(endpoint=endpoint, status=status).inc()

    return counted
