"""The daemon's ``/metrics`` text, in process: its own families (``observe/node.py``) and its
workers' (``observe/workers.py``) from readings shaped as the daemon's status and its
workers' stats are, served by the real app (``observe/server.py``) over a small fake of the
daemon's view, and checked line by line (``helpers.metrics.check_exposition``)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from mlxceld.observe import metrics_app
from mlxceld.observe.catalog import BY_NAME, PROCESS

from helpers.metrics import Samples, check_exposition, sample
from helpers.views import Answer, answer, view_of

KEY = "sk-metrics"
STAGE_STATS = {
    "stage": "stage-0", "layers": [0, 2], "standby": False, "sequences": 2, "queued": 1,
    "rtt_ms": {"next": 0.42}, "steps": 17, "tokens": 40, "refused": 1, "compute_s": 0.5,
    "inline": 3, "prompt_cache": {"bytes": 4096, "entries": 2, "budget": 1 << 20, "hits": 3,
                                  "misses": 1, "tokens_reused": 90, "kept": 4, "evicted": 1}}


class View:
    """What ``scrape`` asks of the daemon, flat (``helpers.views.view_of`` makes its parts)."""

    def __init__(self, workers: list[dict[str, Any]], stats: dict[str, Any], **status: Any):
        self._status = {"daemon": {"node_id": "n1", "hostname": "h1", "started_at": 1000.0},
                        "workers": workers, "agent": {"keys": 2}, "bringup": None,
                        "assignment": None, **status}
        self._stats = stats
        self.liveness: list[dict[str, Any]] = []
        self.drain_rows: list[dict[str, Any]] = []
        self.latest: dict[str, Any] | None = None

    def status(self) -> dict[str, Any]:
        return self._status

    async def worker_stats(self) -> dict[str, Any]:
        return self._stats

    def cluster_nodes(self) -> Answer:
        return Answer({"nodes": [{"address": r["address"]} for r in self.liveness],
                       "liveness": self.liveness})

    def drains(self) -> list[Answer]:
        return [Answer(r) for r in self.drain_rows]

    def rotation(self) -> Answer | None:
        return answer(self.latest)


def worker(name: str, role: str, state: str = "running", **more: Any) -> dict[str, Any]:
    return {"name": name, "role": role, "state": state, "pid": 1234 if state in (
        "running", "starting") else None, "healthy": True if state == "running" else None,
        "restarts": 0, "rss_bytes": 1 << 20, **more}


def get(view: Any, path: str = "/metrics", key: str | None = None,
        require: bool = True, method: str = "GET") -> httpx.Response:
    async def main() -> httpx.Response:
        app = metrics_app(view_of(view), lambda: KEY if key is not None else None,
                          lambda: require)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            return await client.request(method, path, headers=headers)

    return asyncio.run(main())


def scraped(view: Any) -> Samples:
    answer = get(view)
    assert answer.status_code == 200, answer.text
    return check_exposition(answer.text)


def test_workers_up_state_restarts_and_who_answered_in_time() -> None:
    view = View([worker("stage", "stage", restarts=2), worker("quiet", "echo"),
                 worker("gone", "echo", "backoff")], {"stage": STAGE_STATS})
    m = scraped(view)
    assert sample(m, "mlxceld_node_info", node_id="n1", hostname="h1") == 1
    assert sample(m, "mlxceld_worker_up", worker="stage", role="stage") == 1
    assert sample(m, "mlxceld_worker_up", worker="gone", role="echo") == 0
    assert sample(m, "mlxceld_worker_state", worker="gone", role="echo", state="backoff") == 1
    assert sample(m, "mlxceld_worker_state", worker="gone", role="echo", state="running") == 0
    assert sample(m, "mlxceld_worker_restarts_total", worker="stage", role="stage") == 2
    assert sample(m, "mlxceld_worker_scrape_ok", worker="stage", role="stage") == 1
    assert sample(m, "mlxceld_worker_scrape_ok", worker="quiet", role="echo") == 0
    assert sample(m, "mlxceld_worker_scrape_ok", worker="gone", role="echo") is None  # not asked
    assert sample(m, "mlxceld_cluster_keys") == 2
    assert sample(m, "mlxceld_build_info", **{k: v for k, v in next(
        dict(labels) for name, labels in m if name == "mlxceld_build_info").items()}) == 1


def test_a_stage_counts_its_steps_tokens_queue_onward_rtt_and_prompt_cache() -> None:
    m = scraped(View([worker("stage", "stage")], {"stage": STAGE_STATS}))
    at = {"worker": "stage", "stage": "stage-0", "layers": "0-2"}
    assert sample(m, "mlxceld_stage_steps_total", **at) == 17
    assert sample(m, "mlxceld_stage_tokens_total", **at) == 40
    assert sample(m, "mlxceld_stage_queue_depth", **at) == 1
    assert sample(m, "mlxceld_stage_sequences", **at) == 2
    assert sample(m, "mlxceld_stage_standby", **at) == 0
    assert sample(m, "mlxceld_stage_onward_rtt_seconds", **at, link="next") == 0.42 / 1000
    assert sample(m, "mlxceld_prompt_cache_hits_total", worker="stage") == 3
    assert sample(m, "mlxceld_prompt_cache_bytes", worker="stage") == 4096
    assert sample(m, "mlxceld_prompt_cache_evicted_total", worker="stage") == 1


def test_a_last_stage_with_a_draft_counts_its_proposals() -> None:
    spec = {"proposed": 40, "accepted": 30, "passes": 10, "tokens": 40,
            "acceptance_rate": 0.75, "tokens_per_pass": 4.0, "drafted_ahead": 7,
            "draft_s": 0.25}
    m = scraped(View([worker("stage", "stage")], {"stage": {**STAGE_STATS,
                                                            "speculative": spec}}))
    at = {"worker": "stage", "stage": "stage-0", "layers": "0-2"}
    assert sample(m, "mlxceld_stage_speculative_proposed_total", **at) == 40
    assert sample(m, "mlxceld_stage_speculative_accepted_total", **at) == 30
    assert sample(m, "mlxceld_stage_speculative_passes_total", **at) == 10
    assert sample(m, "mlxceld_stage_speculative_tokens_total", **at) == 40
    assert sample(m, "mlxceld_stage_speculative_acceptance_rate", **at) == 0.75
    assert sample(m, "mlxceld_stage_speculative_tokens_per_pass", **at) == 4.0
    assert sample(m, "mlxceld_stage_speculative_drafted_ahead_total", **at) == 7
    assert sample(m, "mlxceld_stage_speculative_draft_wait_seconds_total", **at) == 0.25
    plain = scraped(View([worker("stage", "stage")], {"stage": STAGE_STATS}))
    assert not any(name.startswith("mlxceld_stage_speculative") for name, _ in plain)


def test_handoff_nodes_and_tensor_ranks_and_not_the_routers_engine() -> None:
    stats = {
        "router": {"url": "http://127.0.0.1:8080/v1", "prompt_cache": {"hits": 9}},
        "prefill": {"node_role": "prefill", "handoffs": {"handoffs": 4, "bytes": 1000,
                                                         "refused": 0, "dropped": 1,
                                                         "seconds": 0.25}},
        "tp-1": {"tensor": {"rank": 1, "size": 2, "steps": 55, "sequences": 1}},
        # a tensor stage's follower: the entries of rank 0's prompt cache it holds
        "stage-tp-1": {"tensor": {"rank": 1, "size": 2, "steps": 9, "sequences": 0,
                                  "prompt_cache": {"entries": 3, "bytes": 196608}}}}
    m = scraped(View([worker(n, "router" if "tp-1" not in n else "tp") for n in stats],
                     stats))
    assert sample(m, "mlxceld_kv_handoffs_total", worker="prefill", node_role="prefill") == 4
    assert sample(m, "mlxceld_kv_handoff_bytes_total", worker="prefill",
                  node_role="prefill") == 1000
    assert sample(m, "mlxceld_kv_handoff_seconds_total", worker="prefill",
                  node_role="prefill") == 0.25
    assert sample(m, "mlxceld_tensor_rank_steps_total", worker="tp-1", rank="1") == 55
    assert sample(m, "mlxceld_prompt_cache_hits_total", worker="router") is None
    assert sample(m, "mlxceld_prompt_cache_entries", worker="stage-tp-1") == 3
    assert sample(m, "mlxceld_prompt_cache_bytes", worker="stage-tp-1") == 196608
    assert sample(m, "mlxceld_prompt_cache_entries", worker="tp-1") is None
    assert sample(m, "mlxceld_prompt_cache_hits_total", worker="stage-tp-1") is None


def test_peers_plan_drains_and_rotation() -> None:
    view = View([], {}, bringup={"state": "active", "epoch": 7},
                assignment={"state": "committed", "epoch": 6})
    view.liveness = [{"address": "10.0.0.2:19000", "node_id": "b", "state": "alive",
                      "last_answer": 1500.0},
                     {"address": "10.0.0.3:19000", "node_id": None, "state": "dead",
                      "last_answer": None}]
    view.drain_rows = [{"node_id": "b", "state": "draining"}]
    view.latest = {"step": "verifying_use", "started_at": 1600.0}
    m = scraped(view)
    assert sample(m, "mlxceld_peers_known") == 2
    assert sample(m, "mlxceld_peer_alive", peer="10.0.0.2:19000", node_id="b") == 1
    assert sample(m, "mlxceld_peer_alive", peer="10.0.0.3:19000", node_id="") == 0
    assert sample(m, "mlxceld_peer_state", peer="10.0.0.3:19000", node_id="",
                  state="dead") == 1
    assert sample(m, "mlxceld_peer_last_answer_timestamp_seconds", peer="10.0.0.2:19000",
                  node_id="b") == 1500
    assert sample(m, "mlxceld_plan_epoch", role="coordinator") == 7
    assert sample(m, "mlxceld_plan_active", role="coordinator") == 1
    assert sample(m, "mlxceld_plan_active", role="stage") == 0
    assert sample(m, "mlxceld_drains", state="draining") == 1
    assert sample(m, "mlxceld_drains", state="drained") == 0
    assert sample(m, "mlxceld_drain_state", node="b", state="draining") == 1
    assert sample(m, "mlxceld_secret_rotation_step", step="verifying_use") == 1
    assert sample(m, "mlxceld_secret_rotation_step", step="done") == 0


def test_every_family_served_is_in_the_catalog() -> None:
    view = View([worker("stage", "stage"), worker("tp-1", "tp")],
                {"stage": STAGE_STATS, "tp-1": {"tensor": {"rank": 1, "steps": 1}}},
                bringup={"state": "active", "epoch": 1})
    view.latest = {"step": "done", "started_at": 1.0}
    text = get(view).text
    families = {line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE")}
    exported = {f.exported for f in BY_NAME.values()}
    assert families - set(PROCESS) <= exported, families - set(PROCESS) - exported


def test_the_key_is_needed_unless_the_setting_opens_metrics() -> None:
    view = View([], {})
    refused = get(view, key="")
    assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
    assert get(view, key="wrong").status_code == 401
    assert get(view, key=KEY).status_code == 200
    assert get(view, key="", require=False).status_code == 200  # metrics_require_key false
    assert get(view, "/other", key=KEY).status_code == 404
    assert get(view, "/metrics", key=KEY, method="POST").status_code == 405
