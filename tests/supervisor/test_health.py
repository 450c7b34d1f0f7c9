"""Problems of a set of workers: a pipeline router's unattached stages are problems too."""

from __future__ import annotations

from typing import Any

from mlxceld.supervisor.health import problems


def router(stages: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"name": "router", "role": "router", "state": "running", "healthy": True,
            "reason": "", "last_exit": "", "stats": None if stages is None else
            {"stages": stages}}


def stage(name: str, state: str, error: str | None = None) -> dict[str, Any]:
    return {"stage": name, "address": "127.0.0.3:4000", "layers": [2, 4],
            "connected": state == "attached", "state": state, "error": error}


def test_a_stage_that_is_not_attached_is_a_problem_naming_it_and_why() -> None:
    found = problems([router([stage("s0", "attached"),
                              stage("s1", "model_mismatch", "s1 serves model abc")])])
    assert found == [{"subject": "s1",
                      "message": "worker router cannot reach stage s1 (model mismatch): "
                                 "s1 serves model abc",
                      "next": "mlxctl status on the stage's host (127.0.0.3:4000); "
                              "mlxctl logs router"}]


def test_attached_or_still_connecting_stages_and_no_stats_are_no_problem() -> None:
    assert problems([router([stage("s0", "attached"), stage("s1", "connecting")])]) == []
    assert problems([router(None)]) == []
    assert problems([{**router(None), "stats": {"ticks": 3}}]) == []


def test_a_silent_stage_says_since_when_and_what_to_check() -> None:
    import time

    since = time.mktime((2024, 5, 1, 12, 34, 56, 0, 0, -1))
    silent = {**stage("s1", "silent", "stage s1 is silent: it answered nothing for 3.0 s"),
              "since": since}
    [found] = problems([router([stage("s0", "attached"), silent])])
    assert found["message"] == ("worker router cannot reach stage s1 (silent) since 12:34:56: "
                                "stage s1 is silent: it answered nothing for 3.0 s")
    assert found["next"].startswith("check that the host of stage s1 (127.0.0.3:4000) is "
                                    "awake and on the network")
    assert found["next"].endswith("mlxctl logs router")


def test_a_stage_failed_on_its_host_names_the_reason_and_the_command_there() -> None:
    said = ("stage s1 failed to load layers [2, 4): a shard is missing (on node m2; it is "
            "not restarted until fixed: fix it on m2, then run `mlxctl restart stage` there)")
    [found] = problems([router([stage("s0", "attached"), stage("s1", "failed", said)])])
    assert found["subject"] == "s1"
    assert found["message"] == f"worker router reads stage s1 failed: {said}"
    assert "(127.0.0.3:4000)" in found["next"] and "mlxctl restart stage there" in found["next"]


def test_a_router_nodes_replica_that_is_down_is_a_problem_naming_it_and_why() -> None:
    replicas = [{"replica": "replica-0", "agent": "localhost:19000", "state": "up",
                 "connected": True, "error": None},
                {"replica": "replica-1", "agent": "10.0.0.3:19000", "state": "down",
                 "connected": False, "error": "the node at 10.0.0.3:19000 serves another "
                 "model"},
                {"replica": "replica-2", "agent": "10.0.0.4:19000", "state": "connecting",
                 "connected": False, "error": None}]
    found = problems([{**router(None), "stats": {"replicas": replicas}}])
    assert found == [{"subject": "replica-1",
                      "message": "worker router cannot use replica replica-1 (agent "
                                 "10.0.0.3:19000): the node at 10.0.0.3:19000 serves another "
                                 "model",
                      "next": "on the replica's host (agent 10.0.0.3:19000): mlxctl status; "
                              "it is used again by itself once it serves; mlxctl logs router"}]


def test_a_router_finding_replicas_by_discovery_with_none_yet_is_a_problem() -> None:
    found = problems([{**router(None), "stats": {"replicas": [], "replicas_discovered": 0}}])
    assert [p["subject"] for p in found] == ["router"]
    assert found[0]["message"].startswith("worker router has found no replica by discovery")
    assert "mlxctl cluster nodes" in found[0]["next"]
    assert problems([{**router(None), "stats": {"replicas": []}}]) == []
