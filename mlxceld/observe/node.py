"""The daemon's own metrics, from what one scrape read of it (``Reading``); no IO here.

Its workers (up, lifecycle state, health, restarts, memory, and whether each answered
this scrape's ask for its stats in time), its peers' liveness (the failure detector's),
the pipeline plan it takes part in, drains, the cluster secret's keys and latest
rotation, and its build. The names, kinds and help are ``catalog.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from mlxceld.observe.catalog import new
from mlxceld.state.drains import DRAIN_STATES
from mlxceld.state.rotations import STEPS
from mlxceld.types import JSON, WorkerState

ASKED = frozenset({WorkerState.RUNNING.value, WorkerState.STARTING.value})
PEER_STATES = ("alive", "suspect", "dead", "unknown")


@dataclass(frozen=True)
class Reading:
    """What one scrape read: the daemon's status (``DaemonView.daemon.status``), the stats
    of the workers that answered in time (by name), its cluster nodes (the member's
    ``nodes``), its drains and its latest rotation."""

    status: Mapping[str, Any]
    stats: Mapping[str, JSON]
    nodes: Mapping[str, Any]
    drains: Sequence[Mapping[str, Any]]
    rotation: Mapping[str, Any] | None

    @property
    def workers(self) -> list[JSON]:
        return list(self.status.get("workers") or [])


def asked(worker: Mapping[str, Any]) -> bool:
    """Whether a scrape asks this worker for its stats (``Supervisor.stats``: the running
    and starting ones that have a process)."""
    return worker.get("state") in ASKED and worker.get("pid") is not None


def daemon_families(r: Reading) -> Iterator[Metric]:
    daemon = r.status.get("daemon") or {}
    info = new("mlxceld_node_info")
    info.add_metric([str(daemon.get("node_id", "")), str(daemon.get("hostname", ""))], 1)
    yield info
    started = new("mlxceld_daemon_start_time_seconds")
    started.add_metric([], float(daemon.get("started_at") or 0))
    yield started
    yield from _workers(r.workers, r.stats)
    yield from _peers(r.nodes)
    yield from _plan(r.status)
    yield from _drains(r.drains)
    yield from _keys(r.status, r.rotation)


def _workers(workers: Sequence[Mapping[str, Any]], stats: Mapping[str, JSON]
             ) -> Iterator[Metric]:
    up, state, healthy = new("mlxceld_worker_up"), new("mlxceld_worker_state"), \
        new("mlxceld_worker_healthy")
    restarts, rss = new("mlxceld_worker_restarts"), new("mlxceld_worker_resident_memory_bytes")
    scraped = new("mlxceld_worker_scrape_ok")
    for w in workers:
        labels = [str(w["name"]), str(w["role"])]
        running = w["state"] == WorkerState.RUNNING.value
        up.add_metric(labels, 1 if running else 0)
        for name in WorkerState:
            state.add_metric([*labels, name.value], 1 if w["state"] == name.value else 0)
        if running and w.get("healthy") is not None:
            healthy.add_metric(labels, 1 if w["healthy"] else 0)
        restarts.add_metric(labels, int(w.get("restarts") or 0))
        if w.get("rss_bytes") is not None:
            rss.add_metric(labels, w["rss_bytes"])
        if asked(w):
            scraped.add_metric(labels, 1 if w["name"] in stats else 0)
    yield from (up, state, healthy, restarts, rss, scraped)


def _peers(nodes: Mapping[str, Any]) -> Iterator[Metric]:
    known = new("mlxceld_peers_known")
    known.add_metric([], len(nodes.get("nodes") or []))
    alive, state, answered = new("mlxceld_peer_alive"), new("mlxceld_peer_state"), \
        new("mlxceld_peer_last_answer_timestamp_seconds")
    for row in nodes.get("liveness") or []:
        labels = [str(row["address"]), str(row.get("node_id") or "")]
        alive.add_metric(labels, 1 if row["state"] == "alive" else 0)
        for name in PEER_STATES:
            state.add_metric([*labels, name], 1 if row["state"] == name else 0)
        if row.get("last_answer"):
            answered.add_metric(labels, float(row["last_answer"]))
    yield from (known, alive, state, answered)


def _plan(status: Mapping[str, Any]) -> Iterator[Metric]:
    epoch, active = new("mlxceld_plan_epoch"), new("mlxceld_plan_active")
    for role, part in (("coordinator", status.get("bringup")),
                       ("stage", status.get("assignment"))):
        if part and part.get("epoch") is not None:
            epoch.add_metric([role], int(part["epoch"]))
            active.add_metric([role], 1 if part.get("state") == "active" else 0)
    yield from (epoch, active)


def _drains(drains: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
    count, each = new("mlxceld_drains"), new("mlxceld_drain_state")
    for name in DRAIN_STATES:
        count.add_metric([name], sum(1 for d in drains if d["state"] == name))
    for d in drains:
        for name in DRAIN_STATES:
            each.add_metric([str(d["node_id"]), name], 1 if d["state"] == name else 0)
    yield from (count, each)


def _keys(status: Mapping[str, Any], rotation: Mapping[str, Any] | None) -> Iterator[Metric]:
    keys = new("mlxceld_cluster_keys")
    keys.add_metric([], int((status.get("agent") or {}).get("keys") or 0))
    yield keys
    step, started = new("mlxceld_secret_rotation_step"), \
        new("mlxceld_secret_rotation_started_timestamp_seconds")
    if rotation is not None:
        for name in STEPS:
            step.add_metric([name], 1 if rotation.get("step") == name else 0)
        started.add_metric([], float(rotation.get("started_at") or 0))
    yield from (step, started)
