"""`mlxctl status`'s cluster view as text (``render.pipeline``, ``render.status``): pure,
from a view as the daemon builds it (``control/clusterview.py``); no colour off a terminal."""

from __future__ import annotations

import time
from typing import Any

from mlxctl import render
from mlxctl.drain_view import drain_line

NOW = 1_800_000_000.0


def clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def shown(v: dict[str, Any]) -> list[str]:
    return "\n".join(render.pipeline(v, NOW)).split("\n")  # the table is one string


def view() -> dict[str, Any]:
    link = {"state": "attached", "since": NOW - 60, "address": "127.0.0.2:4000",
            "rtt_ms": 0.42, "error": None}
    peer = {"state": "alive", "since": NOW - 300, "reason": "answered a ping",
            "last_answer": NOW, "key_id": "00112233aabbccdd", "key_stale": False}
    return {
        "epoch": 7, "model": "/m/llama", "state": "active",
        "router": {"worker": "router", "state": "running", "url": "http://127.0.0.1:8080/v1",
                   "tokens": 480, "tokens_per_s": 12.5, "throughput_of": "pipeline"},
        "stages": [
            {"stage": "stage-0", "rank": 0, "node_id": "mac-b", "address": "127.0.0.2:19000",
             "layers": [0, 2], "assignment": "active", "peer": peer, "drain": None,
             "link": {**link, "prompt_cache": {"bytes": 6 << 20, "entries": 3,
                                               "budget": 1 << 30}}},
            {"stage": "stage-1", "rank": 1, "node_id": "mac-c", "address": "127.0.0.3:19000",
             "layers": [2, 4], "assignment": "active",
             "link": {**link, "state": "silent", "since": NOW - 20, "rtt_ms": None,
                      "address": "127.0.0.3:4000",
                      "error": "stage stage-1 is silent: nothing heard for 3.0 s"},
             "peer": {**peer, "state": "dead", "since": NOW - 15, "key_stale": True,
                      "reason": "no answer to pings for 10 s", "key_id": "ffeeddcc99887766"},
             "drain": None}],
        "other_peers": [{"address": "127.0.0.4:19000", "node_id": "mac-d", "state": "alive",
                         "since": NOW - 300, "reason": "answered a ping", "last_answer": NOW,
                         "key_id": "ffeeddcc99887766", "key_stale": True}],
        "key_id": "00112233aabbccdd",
        "drains": [{"node_id": "mac-b", "state": "draining", "started_at": NOW - 5,
                    "deadline": NOW + 55, "force": False, "updated_at": NOW - 5,
                    "reason": "", "finished": 2, "ended": 0}],
        "healing": None,
        "rotation": {"id": 3, "old_key_id": "ffeeddcc99887766",
                     "new_key_id": "00112233aabbccdd", "members": ["a", "b"],
                     "step": "using", "failures": {}, "started_at": NOW - 4,
                     "updated_at": NOW, "in_progress": True},
    }


def test_the_view_shows_plan_router_throughput_and_each_stage() -> None:
    lines = shown(view())
    assert lines[:4] == [
        "", "cluster: plan 7 (active) · model /m/llama",
        "  router http://127.0.0.1:8080/v1 (running) · 12.5 tokens/s (the pipeline's, last "
        "10 s)",
        "stages of router: 1 of 2 attached"]
    head, s0, s1 = lines[4:7]
    assert head.split() == ["STAGE", "NODE", "LAYERS", "LINK", "FOR", "RTT", "ADDRESS",
                            "PEER", "PEER", "SINCE", "KEY", "CACHE"]
    assert s0.endswith("00112233aabbccdd  6.0 MiB/3")
    assert s0.split()[:9] == ["stage-0", "mac-b", "[0,", "2)", "attached", "1m00s", "0.4",
                              "ms", "127.0.0.2:4000"]
    assert f"alive  {clock(NOW - 300)} (5m00s ago)  00112233aabbccdd" in s0
    assert s1.split()[:7] == ["stage-1", "mac-c", "[2,", "4)", "silent", "20s", "-"]
    assert f"dead   {clock(NOW - 15)} (15s ago)    ffeeddcc99887766" in s1
    assert s1.split()[-1] == "-"  # no cache said
    assert lines[7:] == [
        "  stage-1: stage stage-1 is silent: nothing heard for 3.0 s",
        "  stage-1 (mac-c): dead: no answer to pings for 10 s",
        f"peer mac-d (127.0.0.4:19000, no stage): alive since {clock(NOW - 300)} (5m00s "
        "ago), key ffeeddcc99887766 (not ours: it missed a secret rotation)",
        f"drain: node mac-b draining since {clock(NOW - 5)} (5s ago), deadline in 55s: 2 "
        "finished, 0 ended",
        f"secret rotation 3 to key 00112233aabbccdd: using (2 member(s), since "
        f"{clock(NOW - 4)} (4s ago))"]


def test_a_plan_without_a_router_and_a_finished_rotation() -> None:
    v = view()
    v["router"] = None
    v["state"] = "pushing"
    v["drains"] = []
    v["other_peers"] = []
    v["rotation"] = {**v["rotation"], "step": "done", "in_progress": False}
    for s in v["stages"]:
        s["link"] = None
    lines = shown(v)
    assert lines[1:4] == ["cluster: plan 7 (pushing) · model /m/llama",
                          "  router not started", "stages of router: 0 of 2 attached"]
    assert lines[5].split()[:8] == ["stage-0", "mac-b", "[0,", "2)", "-", "-", "-", "-"]
    assert not any("rotation" in line or "drain" in line for line in lines)
    v.update(epoch=None, state="planning", model=None, stages=[])
    assert shown(v)[1:] == ["cluster: no plan yet (planning)", "  router not started"]
    v["state"] = None  # a router over a written cluster config
    assert shown(v)[1] == "cluster: a written cluster config"


def test_status_shows_the_view_in_place_of_the_links_and_the_problems_below() -> None:
    body = {"daemon": {"version": "1", "state": "running", "node_id": "coord", "pid": 9,
                       "uptime_s": 5},
            "workers": [], "serving": None, "cluster": None, "assignment": None,
            "bringup": None, "healing": None, "pipeline": view(),
            "problems": [{"subject": "mac-c", "message": "node mac-c (127.0.0.3:19000) of "
                          "the active plan is dead since ...", "next": "check the host"}]}
    text = render.status(body)
    assert "cluster: plan 7 (active)" in text and "stages of router: 1 of 2 attached" in text
    assert text.endswith("health: 1 problem(s)\n  x node mac-c (127.0.0.3:19000) of the "
                         "active plan is dead since ...\n    next: check the host")
    body["pipeline"] = None  # a peer, or an older daemon: the router's links as before
    assert "cluster: plan" not in render.status(body)


def test_a_loading_stage_says_how_far_it_is() -> None:
    """``mlxctl status``: a stage loading its weights (its ``loading`` stat)."""
    workers = [{"name": "stage", "stats": {"loading": {"done": 43 * 2**28, "total": 100 * 2**28,
                                                       "since": NOW - 12.4}}},
               {"name": "router", "stats": {"steps": 3}}, {"name": "other", "stats": None}]
    assert render.loading(workers, NOW) == ["stage: loading 43% of 25.0 GiB, 12 s"]
    small = [{"name": "stage", "stats": {"loading": {"done": 0, "total": 3 * 2**20,
                                                     "since": NOW}}}]
    assert render.loading(small, NOW) == ["stage: loading 0% of 3.0 MiB, 0 s"]
    assert render.loading([{"name": "stage", "stats": {"loading": {"done": "x"}}}], NOW) == []
    fetching = [{"name": "stage", "stats": {"loading": {"done": 2**29, "total": 2**31,
                                                        "since": NOW - 3,
                                                        "step": "downloading"}}}]
    assert render.loading(fetching, NOW) == ["stage: downloading 25% of 2.0 GiB, 3 s"]


def test_a_router_nodes_replicas_show_with_their_state_and_why_one_is_down() -> None:
    worker = {"name": "router", "state": "running", "pid": 9, "restarts": 0, "healthy": True,
              "stats": {"replicas": [
                  {"replica": "replica-0", "agent": "localhost:19000", "state": "up",
                   "connected": True, "error": None, "dispatched": 5},
                  {"replica": "replica-1", "agent": "10.0.0.3:19000", "state": "down",
                   "connected": False, "error": "node replica-1 is unreachable",
                   "dispatched": 2}]}}
    lines = "\n".join(render.replica_links([worker]))
    assert "replicas of router: 1 of 2 up" in lines
    assert "replica-1: node replica-1 is unreachable" in lines
    assert "10.0.0.3:19000" in lines and "localhost:19000" in lines


def test_a_stage_hosts_status_says_what_its_prompt_cache_holds_and_did() -> None:
    stage = {"name": "stage", "role": "stage", "state": "running",
             "stats": {"stage": "stage-1", "prompt_cache": {
                 "bytes": 3 << 20, "entries": 2, "budget": 1 << 30, "hits": 7, "misses": 1,
                 "tokens_reused": 900, "kept": 9, "evicted": 4}}}
    assert render.stage_caches([stage, {"name": "router", "role": "router", "stats": {}}]) == [
        "stage: prompt cache: 7 hits, 1 miss, 900 tokens reused; holds 2 caches, 3.0 MiB of "
        "1.0 GiB"]
    pipeline = {"hits": 4, "misses": 2, "tokens_reused": 300, "entries": 1, "bytes": 2048,
                "lost": 1, "pending": 0}  # a pipeline router's
    assert render.prompt_cache(pipeline) == (
        "prompt cache: 4 hits, 2 misses, 300 tokens reused; holds 1 cache, 2 KiB; 1 lost by "
        "a stage (prefilled whole)")


def test_the_served_context_and_the_prompt_cache_show_beside_the_model() -> None:
    """A single-host router's stats: the context it serves (``[serve] context_length``
    caps the model's) beside the model, and its engine's prompt cache."""
    router = {"name": "router", "role": "router", "state": "running", "pid": 10, "restarts": 0,
              "stats": {"url": "http://127.0.0.1:8080/v1", "model": "tiny",
                        "context_length": 2048,
                        "prompt_cache": {"hits": 3, "misses": 1, "tokens_reused": 1200,
                                         "entries": 2, "bytes": 12 * 2**20}}}
    body = {"daemon": {"version": "1", "state": "running", "node_id": "mac-a", "pid": 9,
                       "uptime_s": 5},
            "workers": [router],
            "serving": {"model_name": "tiny", "url": "http://127.0.0.1:8080/v1",
                        "api_key": True},
            "cluster": None, "assignment": None, "bringup": None, "healing": None,
            "pipeline": None, "problems": []}
    lines = render.status(body).split("\n")
    assert lines[1:3] == [
        "serving tiny (context 2048 tokens) at http://127.0.0.1:8080/v1 (API key required)",
        "prompt cache: 3 hits, 1 miss, 1200 tokens reused; holds 2 caches, 12.0 MiB"]
    router["stats"] = {"prompt_cache": {"hits": 1, "misses": 0, "tokens_reused": 1,
                                        "entries": 1, "bytes": 0}}  # still loading: no context
    lines = render.status(body).split("\n")
    assert lines[1:3] == [
        "serving tiny at http://127.0.0.1:8080/v1 (API key required)",
        "prompt cache: 1 hit, 0 misses, 1 token reused; holds 1 cache, 0 B"]
    # a prefill node: no OpenAI port, its prompt cache all the same
    router["stats"] = {"serving": "10.0.0.3:19200", "node_role": "prefill",
                       "prompt_cache": {"hits": 0, "misses": 2, "tokens_reused": 0,
                                        "entries": 2, "bytes": 3 * 2**30}}
    lines = render.status(body).split("\n")
    assert lines[1:3] == [
        "prefill node: serving listener at 10.0.0.3:19200 (for the cluster's routers; no "
        "OpenAI port)", "prompt cache: 0 hits, 2 misses, 0 tokens reused; holds 2 caches, "
        "3.0 GiB"]


def test_a_node_without_a_cluster_view_shows_its_drains() -> None:
    """A single node (or a peer, a replica) has no ``pipeline`` view: its drains, the
    status's ``drains``, are shown after its workers; none, no line."""
    body = {"daemon": {"version": "1", "state": "running", "node_id": "solo", "pid": 9,
                       "uptime_s": 5},
            "workers": [], "serving": None, "cluster": None, "assignment": None,
            "bringup": None, "healing": None, "pipeline": None, "problems": [],
            "drains": [{"node_id": "solo", "state": "drained", "started_at": time.time() - 3,
                        "deadline": None, "finished": 2, "ended": 0}]}
    lines = render.status(body).split("\n")
    drains = [line for line in lines if line.startswith("drain:")]
    assert len(drains) == 1 and drains[0].startswith("drain: node solo drained since ")
    assert drains[0].endswith("ago), no deadline: 2 finished, 0 ended")
    assert lines.index(drains[0]) < lines.index("health: ok")
    body["drains"] = []
    assert "drain" not in render.status(body)
    del body["drains"]  # an older daemon's status
    assert "drain" not in render.status(body)


def test_a_drain_line_names_who_still_sends_work() -> None:
    """A serving node's drain (``senders``: its OpenAI clients, each router with sequences
    on it) says who is still running there; one without says nothing more."""
    drain = {"node_id": "hyb-a", "state": "draining", "started_at": NOW - 2,
             "deadline": NOW + 58, "finished": 1, "ended": 0,
             "senders": [{"sender": "clients of the OpenAI port", "sequences": 1},
                         {"sender": "router 127.0.0.1:19000", "sequences": 3}]}
    assert drain_line(drain, NOW) == (
        f"drain: node hyb-a draining since {clock(NOW - 2)} (2s ago), deadline in 58s: 1 "
        "finished, 0 ended; 1 from clients of the OpenAI port; 3 from router "
        "127.0.0.1:19000")
    assert drain_line({**drain, "senders": None}, NOW).endswith("1 finished, 0 ended")


def test_front_standby_and_stood_down_each_say_their_summary_in_order() -> None:
    """A router in front of a pipeline (``front``), a standby coordinator (``standby``) and
    a coordinator a standby superseded (``stood_down``): one line each, their summary,
    whatever other keys they carry; none, no line."""
    body: dict[str, Any] = {
        "daemon": {"version": "1", "state": "running", "node_id": "r2", "pid": 9,
                   "uptime_s": 5},
        "workers": [], "serving": None, "cluster": None, "assignment": None,
        "bringup": None, "healing": None, "pipeline": None, "problems": [],
        "front": {"coordinator": "127.0.0.1:19000", "state": "following",
                  "summary": "following coordinator 127.0.0.1:19000: plan 3 (2 stages)"},
        "standby": {"state": "standing by", "took_over": False, "new_key": [1, 2],
                    "summary": "standing by for coordinator 127.0.0.1:19000"},
        "stood_down": {"epoch": 3, "summary": "plan 3 was superseded by plan 4"}}
    lines = render.status(body).split("\n")
    assert lines[1:4] == [
        "front: following coordinator 127.0.0.1:19000: plan 3 (2 stages)",
        "standby: standing by for coordinator 127.0.0.1:19000",
        "coordinator: stood down: plan 3 was superseded by plan 4"]
    body.update(front=None, stood_down={})
    del body["standby"]  # an older daemon's status
    assert render.status(body).split("\n")[1:3] == ["", "no workers configured (the daemon "
                                                        "is idle: control plane only)"]


def test_the_compute_units_line() -> None:
    """``daemon.compute_units`` (discovery/speed.py): declared, measured, measuring, or why
    not; nothing on a daemon that never measured (no agent listener)."""
    body = {"daemon": {"version": "1", "state": "running", "node_id": "mac-a", "pid": 9,
                       "uptime_s": 5},
            "workers": [], "serving": None, "cluster": None, "assignment": None,
            "bringup": None, "healing": None, "pipeline": None, "problems": []}
    speeds = [
        ({"units": 41.25, "source": "measured", "dtype": "bfloat16", "error": None},
         "compute units: 41.25 (measured in bfloat16)"),
        ({"units": 100.0, "source": "declared", "dtype": "bfloat16", "error": None},
         "compute units: 100 (declared)"),
        ({"units": None, "source": "measuring", "dtype": "float16", "error": None},
         "compute units: measuring (in float16)"),
        ({"units": None, "source": "unmeasured", "dtype": "bfloat16", "error": "too slow"},
         "compute units: not measured: too slow (plans split by memory)"),
    ]
    for speed, line in speeds:
        body["daemon"]["compute_units"] = speed
        assert render.status(body).split("\n")[1] == line
    body["daemon"]["compute_units"] = {"units": None, "source": "unmeasured",
                                       "dtype": "bfloat16", "error": None}
    assert "compute units" not in render.status(body)
