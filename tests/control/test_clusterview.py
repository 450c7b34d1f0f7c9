"""The coordinator's cluster view (``pipeline`` of ``GET /v1/status``, ``mlxctl.status/1``):
built from the status, the nodes, the drains and the rotation as the daemon keeps them
(pure: no I/O); its field names are pinned here, as mlxctl(1) documents them."""

from __future__ import annotations

import copy
from typing import Any

from mlxceld.control import clusterview

NOW = 1_800_000_000.0
B, C, D, E = "127.0.0.2:19000", "127.0.0.3:19000", "127.0.0.4:19000", "127.0.0.5:19000"
OURS, OLD = "00112233aabbccdd", "ffeeddcc99887766"

VIEW_KEYS = {"epoch", "model", "state", "router", "stages", "other_peers", "key_id", "drains",
             "healing", "rotation"}
STAGE_KEYS = {"stage", "rank", "node_id", "address", "layers", "assignment", "link", "peer",
              "drain"}
LINK_KEYS = {"state", "since", "address", "rtt_ms", "error", "prompt_cache"}
PEER_KEYS = {"state", "since", "reason", "last_answer", "key_id", "key_stale"}
ROUTER_KEYS = {"worker", "state", "url", "tokens", "tokens_per_s", "throughput_of"}
CACHE = {"enabled": True, "lookups": 4, "hits": 3, "misses": 0, "tokens_reused": 300,
         "entries": 2, "pending": 0, "bytes": 4096}


def status() -> dict[str, Any]:
    """A coordinator serving plan 7 over two peers; stage-1's host is asleep."""
    link = {"stage": "stage-0", "layers": [0, 2], "connected": True, "state": "attached",
            "error": None, "since": NOW - 60, "failures": 0, "address": "127.0.0.2:4000",
            "silence_s": 3.0, "rtt_ms": 0.42,
            "prompt_cache": {"bytes": 2048, "entries": 2, "budget": 1 << 30}}
    silent = {**link, "stage": "stage-1", "layers": [2, 4], "connected": False,
              "state": "silent", "error": "stage stage-1 is silent: nothing heard for 3.0 s",
              "since": NOW - 20, "address": "127.0.0.3:4000", "rtt_ms": None}
    return {
        "serving": {"model_name": "llama", "url": "http://127.0.0.1:8080/v1"},
        "bringup": {"state": "active", "epoch": 7, "model": "/m/llama", "stages": 2,
                    "summary": "", "peers": [
                        {"stage": "stage-0", "node_id": "mac-b", "address": B,
                         "layers": [0, 2], "state": "active", "steps": []},
                        {"stage": "stage-1", "node_id": "mac-c", "address": C,
                         "layers": [2, 4], "state": "active", "steps": []}]},
        "healing": {"state": "waiting", "summary": "mac-c dead", "heal_after_s": 60},
        "workers": [{"name": "router", "role": "router", "state": "running",
                     "stats": {"url": "http://127.0.0.1:8080/v1", "stages": [link, silent],
                               "tokens": 480, "tokens_per_s": 12.5,
                               "prompt_cache": CACHE}}],
    }


def nodes() -> dict[str, Any]:
    """B and C, the plan's; D a spare; E a host the detector watched once (no candidate)."""
    alive = {"address": B, "state": "alive", "since": NOW - 300, "reason": "answered a ping",
             "node_id": "mac-b", "last_answer": NOW - 0.2, "updated_at": NOW}
    dead = {"address": C, "state": "dead", "since": NOW - 15,
            "reason": "no answer to pings for 10 s", "node_id": "mac-c",
            "last_answer": NOW - 25, "updated_at": NOW}
    spare = {**alive, "address": D, "node_id": None}
    gone = {**dead, "address": E, "node_id": "old-e"}
    return {"key_id": OURS, "liveness": [alive, dead, spare, gone], "nodes": [
        {"address": B, "node_id": "mac-b", "key_id": OURS, "key_stale": False,
         "liveness": alive},
        {"address": C, "node_id": "mac-c", "key_id": OLD, "key_stale": True,
         "liveness": dead},
        {"address": D, "node_id": "mac-d", "key_id": OURS, "key_stale": False,
         "liveness": spare}]}


DRAIN = {"node_id": "mac-b", "state": "draining", "started_at": NOW - 5,
         "deadline": NOW + 55, "force": False, "updated_at": NOW - 5, "reason": "",
         "finished": 2, "ended": 0}
ROTATION = {"id": 3, "old_key_id": OLD, "new_key_id": OURS, "members": [B, C],
            "step": "verifying_use", "failures": {}, "started_at": NOW - 4,
            "updated_at": NOW - 1}


def test_the_view_of_a_coordinator_names_each_stage_its_node_link_and_peer() -> None:
    view = clusterview.pipeline_view(status(), nodes(), [DRAIN], ROTATION)
    assert view is not None
    assert set(view) == VIEW_KEYS
    assert (view["epoch"], view["model"], view["state"]) == (7, "/m/llama", "active")
    assert view["router"] == {"worker": "router", "state": "running",
                              "url": "http://127.0.0.1:8080/v1", "tokens": 480,
                              "tokens_per_s": 12.5, "throughput_of": "pipeline"}
    s0, s1 = view["stages"]
    assert all(set(s) == STAGE_KEYS for s in view["stages"])
    assert (s0["stage"], s0["rank"], s0["node_id"], s0["address"], s0["layers"],
            s0["assignment"]) == ("stage-0", 0, "mac-b", B, [0, 2], "active")
    assert s0["link"] == {"state": "attached", "since": NOW - 60,
                          "address": "127.0.0.2:4000", "rtt_ms": 0.42, "error": None,
                          "prompt_cache": {"bytes": 2048, "entries": 2, "budget": 1 << 30}}
    assert s0["peer"] == {"state": "alive", "since": NOW - 300, "reason": "answered a ping",
                          "last_answer": NOW - 0.2, "key_id": OURS, "key_stale": False}
    assert s0["drain"] == DRAIN and s1["drain"] is None
    assert s1["link"] is not None and set(s1["link"]) == LINK_KEYS
    assert s1["link"]["state"] == "silent" and s1["link"]["rtt_ms"] is None
    assert s1["peer"] is not None and set(s1["peer"]) == PEER_KEYS
    assert (s1["peer"]["state"], s1["peer"]["key_stale"]) == ("dead", True)
    assert view["other_peers"] == [
        {"address": D, "node_id": "mac-d", "state": "alive", "since": NOW - 300,
         "reason": "answered a ping", "last_answer": NOW - 0.2, "key_id": OURS,
         "key_stale": False},
        {"address": E, "node_id": "old-e", "state": "dead", "since": NOW - 15,
         "reason": "no answer to pings for 10 s", "last_answer": NOW - 25, "key_id": None,
         "key_stale": False}]
    assert all(set(p) == PEER_KEYS | {"address", "node_id"} for p in view["other_peers"])
    assert view["key_id"] == OURS and view["drains"] == [DRAIN]
    assert view["healing"] == status()["healing"]
    assert view["rotation"] == {**ROTATION, "in_progress": True}
    assert view["router"] is not None and set(view["router"]) == ROUTER_KEYS


def test_the_view_holds_what_is_known_while_a_plan_is_pushed_or_written() -> None:
    pushing = status()
    pushing["workers"] = []  # no router yet
    pushing["bringup"]["state"] = "pushing"
    view = clusterview.pipeline_view(pushing, {"key_id": OURS}, [], None)
    assert view is not None and view["router"] is None and view["rotation"] is None
    assert [(s["stage"], s["link"], s["peer"]) for s in view["stages"]] == [
        ("stage-0", None, None), ("stage-1", None, None)]
    written = status()  # a --distributed-config cluster: a router over stages, no plan
    written["bringup"] = None
    view = clusterview.pipeline_view(written, {}, [], None)
    assert view is not None and view["epoch"] is None
    assert [(s["stage"], s["rank"], s["node_id"], s["layers"]) for s in view["stages"]] == [
        ("stage-0", 0, None, [0, 2]), ("stage-1", 1, None, [2, 4])]


def test_no_view_on_a_peer_or_a_single_host() -> None:
    single = {"bringup": None, "workers": [{"name": "router", "role": "router",
                                            "state": "running", "stats": {"url": "u"}}]}
    peer = {"bringup": None, "workers": [{"name": "stage", "role": "stage",
                                          "state": "running", "stats": {"stage": "stage-1"}}]}
    for body in (single, peer, {"workers": []}):
        assert not clusterview.serves_pipeline(body)
        assert clusterview.pipeline_view(body, {}, [], None) is None
    assert clusterview.serves_pipeline(status())
    ended = {"bringup": {"state": "deactivated", "epoch": 7, "peers": []}, "workers": []}
    assert not clusterview.serves_pipeline(ended)  # `bring-up: deactivated` says it all
    assert clusterview.problems(None) == []


def test_a_peer_left_on_another_key_and_a_failed_rotation_are_problems() -> None:
    failed = {**ROTATION, "step": "failed", "failures": {C: "verifying_use: unreachable"}}
    view = clusterview.pipeline_view(status(), nodes(), [], failed)
    assert view is not None and view["rotation"] is not None
    assert view["rotation"]["in_progress"] is False
    stale, rotation = clusterview.problems(view)
    assert stale["subject"] == "mac-c"
    assert stale["message"] == (f"node mac-c (stage-1) dials with key {OLD}, this "
                                f"coordinator with {OURS}: it missed a secret rotation, and "
                                "its traffic fails once the old key is removed")
    assert stale["next"].startswith("on node mac-c: mlxctl secret install FILE --primary")
    assert rotation["subject"] == "rotation"
    assert rotation["message"] == (f"secret rotation 3 to key {OURS} failed: member {C} "
                                   "failed verifying_use: unreachable")
    assert "mlxctl secret rotate" in rotation["next"]
    fresh = copy.deepcopy(nodes())
    fresh["nodes"][1]["key_stale"] = False
    assert clusterview.problems(clusterview.pipeline_view(status(), fresh, [], None)) == []
    fresh["nodes"][2]["key_stale"] = True  # a spare: used by the next heal, so said now
    [spare] = clusterview.problems(clusterview.pipeline_view(status(), fresh, [], None))
    assert spare["subject"] == "mac-d" and spare["message"].startswith(
        f"node mac-d (no stage) dials with key {OURS}")


def test_no_key_problem_while_a_rotation_runs() -> None:
    """Mid-rotation the members switch primaries one by one: a stale key is expected."""
    view = clusterview.pipeline_view(status(), nodes(), [], ROTATION)  # verifying_use
    assert view is not None and view["stages"][1]["peer"]["key_stale"]  # type: ignore[index]
    assert clusterview.problems(view) == []


def test_a_stage_problem_names_the_node_that_runs_it() -> None:
    view = clusterview.pipeline_view(status(), nodes(), [], None)
    link = {"subject": "stage-1", "message": "worker router cannot reach stage stage-1 "
            "(silent) since 08:00:00: ...", "next": "check the host"}
    other = {"subject": "healing", "message": "self-healing refused", "next": "x"}
    named, same = clusterview.name_nodes([link, other], view)
    assert named == {**link, "message": link["message"] + " (stage stage-1 runs on node "
                     f"mac-c, agent {C})"}
    assert same is other
    assert clusterview.name_nodes([link], None) == [link]
