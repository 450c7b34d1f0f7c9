"""Every metric family a daemon's ``/metrics`` serves (``[daemon] metrics_listen``), by name.

One table: the families are made from it (``new``), so a name served is a name listed,
and mlxceld(8)'s METRICS section and the Grafana dashboard (contrib/grafana) are checked
against it (tests/observe). A counter's samples end in ``_total`` (``exported``), as
prometheus-client writes them. ``vllm``: the name vLLM gives the same measure, where it
has one. The router's own families (on its OpenAI port) are ``api/edge/metrics.py``'s; the
prompt cache's names are the same here and there, with the labels each one names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Kind = Literal["counter", "gauge"]
WORKER: Final = ("worker", "role")
STAGE: Final = ("worker", "stage", "layers")


@dataclass(frozen=True)
class Family:
    name: str  # a counter's without ``_total``
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    vllm: str | None = None

    @property
    def exported(self) -> str:
        """The name its samples carry."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    def new(self) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty family of this name, kind, help and labels, to add samples to."""
        kind = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        return kind(self.name, self.help, labels=list(self.labels))


def _f(name: str, kind: Kind, text: str, labels: tuple[str, ...] = (),
       vllm: str | None = None) -> Family:
    return Family(name, kind, text, labels, vllm)


FAMILIES: Final = (
    # -- the daemon -------------------------------------------------------------------------
    _f("mlxceld_build_info", "gauge", "The versions this daemon runs",
       ("version", "python", "mlx", "mlx_lm")),
    _f("mlxceld_node_info", "gauge", "This daemon's node id and host name",
       ("node_id", "hostname")),
    _f("mlxceld_daemon_start_time_seconds", "gauge", "When the daemon started (Unix time)"),
    _f("mlxceld_worker_up", "gauge", "1 while the worker runs, else 0", WORKER),
    _f("mlxceld_worker_state", "gauge", "Each worker's lifecycle state: 1 for the one it is "
       "in", (*WORKER, "state")),
    _f("mlxceld_worker_healthy", "gauge", "1 when a running worker's last health probe "
       "passed, else 0", WORKER),
    _f("mlxceld_worker_restarts", "counter", "Automatic restarts of each worker", WORKER),
    _f("mlxceld_worker_resident_memory_bytes", "gauge", "Each running worker's resident "
       "memory", WORKER),
    _f("mlxceld_worker_scrape_ok", "gauge", "1 when a running or starting worker answered "
       "this scrape's ask for its stats in time, 0 when it did not", WORKER),
    _f("mlxceld_peers_known", "gauge", "Peers this daemon knows of (static, discovered)"),
    _f("mlxceld_peer_alive", "gauge", "1 while the failure detector holds the peer alive",
       ("peer", "node_id")),
    _f("mlxceld_peer_state", "gauge", "Each watched peer's liveness: 1 for the state it is "
       "in", ("peer", "node_id", "state")),
    _f("mlxceld_peer_last_answer_timestamp_seconds", "gauge", "When the peer last answered "
       "a heartbeat (Unix time)", ("peer", "node_id")),
    _f("mlxceld_plan_epoch", "gauge", "The latest pipeline plan's epoch, as this daemon's "
       "role in it sees it (coordinator: its bring-up; stage: its assignment)", ("role",)),
    _f("mlxceld_plan_active", "gauge", "1 while that plan is active", ("role",)),
    _f("mlxceld_drains", "gauge", "Nodes being drained (draining) or drained", ("state",)),
    _f("mlxceld_drain_state", "gauge", "Each drained node: 1 for the state it is in",
       ("node", "state")),
    _f("mlxceld_cluster_keys", "gauge", "Cluster secrets in this daemon's keyring"),
    _f("mlxceld_secret_rotation_step", "gauge", "The latest secret rotation's step: 1 for "
       "the one it is at", ("step",)),
    _f("mlxceld_secret_rotation_started_timestamp_seconds", "gauge", "When the latest secret "
       "rotation started (Unix time)"),
    # -- a pipeline stage -------------------------------------------------------------------
    _f("mlxceld_stage_steps", "counter", "Forward passes of the stage's layers (a batch is "
       "one)", STAGE),
    _f("mlxceld_stage_tokens", "counter", "Tokens through the stage's layers", STAGE),
    _f("mlxceld_stage_refused", "counter", "Sequences the stage refused", STAGE),
    _f("mlxceld_stage_compute_seconds", "counter", "Time in the stage's layers", STAGE),
    _f("mlxceld_stage_sequences", "gauge", "Sequences the stage holds", STAGE,
       "vllm:num_requests_running"),
    _f("mlxceld_stage_queue_depth", "gauge", "Steps queued at the stage, not yet run", STAGE),
    _f("mlxceld_stage_standby", "gauge", "1 while the stage is prepared but not activated",
       STAGE),
    _f("mlxceld_stage_onward_rtt_seconds", "gauge", "Round trip of the latest heartbeat "
       "answered on the stage's connection onward (link: next, to the next stage; first, "
       "from the last stage to the first)", (*STAGE, "link")),
    # -- a pipeline's last stage with a draft (pipeline/speculating.py) ------------------------
    _f("mlxceld_stage_speculative_proposed", "counter", "Draft tokens the last stage's draft "
       "proposed (speculative decoding)", STAGE),
    _f("mlxceld_stage_speculative_accepted", "counter", "Draft tokens the model accepted",
       STAGE),
    _f("mlxceld_stage_speculative_passes", "counter", "Passes through the stages with "
       "proposals", STAGE),
    _f("mlxceld_stage_speculative_tokens", "counter", "Tokens those passes gave", STAGE),
    _f("mlxceld_stage_speculative_acceptance_rate", "gauge", "Draft tokens accepted over "
       "proposed, since the stage started", STAGE),
    _f("mlxceld_stage_speculative_tokens_per_pass", "gauge", "Tokens a pass with proposals "
       "gave, on average since the stage started", STAGE),
    _f("mlxceld_stage_speculative_drafted_ahead", "counter", "Passes whose proposals were "
       "drafted while the pass before was away", STAGE),
    _f("mlxceld_stage_speculative_draft_wait_seconds", "counter", "Time the last stage "
       "waited for its draft (drafting ahead runs meanwhile)", STAGE),
    # -- a prompt (prefix) cache: a stage's, a prefill or decode node's ---------------------
    _f("mlxceld_prompt_cache_hits", "counter", "Prompt cache lookups that reused a cached "
       "prefix", ("worker",), "vllm:prefix_cache_hits"),
    _f("mlxceld_prompt_cache_misses", "counter", "Prompt cache lookups that found no prefix "
       "to reuse", ("worker",)),
    _f("mlxceld_prompt_cache_tokens_reused", "counter", "Prompt tokens taken from the prompt "
       "cache, not prefilled", ("worker",)),
    _f("mlxceld_prompt_cache_entries", "gauge", "KV caches the prompt cache holds (a "
       "tensor stage's follower: those of its rank 0 it mirrors)", ("worker",)),
    _f("mlxceld_prompt_cache_bytes", "gauge", "Bytes of the KV caches the prompt cache "
       "holds (a tensor stage's follower: of its shards)", ("worker",)),
    _f("mlxceld_prompt_cache_budget_bytes", "gauge", "The prompt cache's bound in bytes",
       ("worker",)),
    _f("mlxceld_prompt_cache_evicted", "counter", "Entries the prompt cache dropped to stay "
       "in its bound", ("worker",)),
    # -- a prefill or decode node -----------------------------------------------------------
    _f("mlxceld_kv_handoffs", "counter", "KV caches handed off (prefill: sent; decode: "
       "taken)", ("worker", "node_role")),
    _f("mlxceld_kv_handoff_bytes", "counter", "Bytes of the KV caches handed off",
       ("worker", "node_role")),
    _f("mlxceld_kv_handoff_seconds", "counter", "Time in handoffs (prefill: encoding and "
       "sending; decode: decoding)", ("worker", "node_role")),
    _f("mlxceld_kv_handoffs_refused", "counter", "Handoffs refused", ("worker", "node_role")),
    _f("mlxceld_kv_handoffs_dropped", "counter", "Handoffs dropped", ("worker", "node_role")),
    # -- a tensor-parallel rank -------------------------------------------------------------
    _f("mlxceld_tensor_rank_steps", "counter", "Batch steps the rank took after rank 0",
       ("worker", "rank")),
    _f("mlxceld_tensor_rank_sequences", "gauge", "Sequences in the rank's batch",
       ("worker", "rank")),
)
BY_NAME: Final = {f.name: f for f in FAMILIES}
# What every process serves besides, read by api/edge/metrics.py's ``process_metrics``.
PROCESS: Final = ("process_resident_memory_bytes", "process_cpu_seconds_total",
                  "process_open_fds", "process_start_time_seconds")


def new(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """``BY_NAME[name].new()``: a family not in the table is a bug (KeyError)."""
    return BY_NAME[name].new()
