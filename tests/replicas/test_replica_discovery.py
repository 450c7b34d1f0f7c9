"""``workers/replica_router.py``'s ``Discovered``: the daemon's candidates into a pool's
members. Fakes of our own seams: the pool (``add``, ``retire``), the agents' answers
(``ServingFinder``'s ``ServingNotFound`` or an address) and the members; a fake clock."""

from __future__ import annotations

import asyncio
from typing import Any

from mlxceld.discovery.serving import ServingNotFound
from mlxceld.workers.replica_router import ASK_AGAIN_S, Discovered


class Pool:
    def __init__(self) -> None:
        self.members: dict[str, Any] = {}
        self.retired: list[str] = []

    def add(self, member: Any) -> None:
        assert member.node_id not in self.members
        self.members[member.node_id] = member

    def retire(self, node_id: str) -> None:
        self.retired.append(node_id)
        del self.members[node_id]


class Member:
    def __init__(self, node_id: str, find: Any) -> None:
        self.node_id = node_id
        self.agent = find.agent


def test_candidates_serving_the_model_join_others_are_asked_again_later() -> None:
    async def run() -> None:
        serving = {"10.0.0.2:19000": True, "10.0.0.3:19000": False}
        asked: list[str] = []
        now = [0.0]

        def finder(agent: str) -> Any:
            async def find() -> str:
                asked.append(agent)
                if not serving.get(agent):
                    raise ServingNotFound("it is a router, not a hybrid node serving the model")
                return agent.replace("19000", "19100")
            find.agent = agent  # type: ignore[attr-defined]
            return find

        pool = Pool()
        found = Discovered(pool, finder, Member, clock=lambda: now[0])
        two = [{"node_id": "n2", "agent": "10.0.0.2:19000"},
               {"node_id": "n3", "agent": "10.0.0.3:19000"}]
        assert found.op({"candidates": two}) == {"ok": True, "members": []}
        await asyncio.sleep(0.01)
        assert sorted(pool.members) == ["replica-n2"] and sorted(asked) == sorted(serving)
        assert found.op({"candidates": two})["members"] == ["replica-n2"]
        await asyncio.sleep(0.01)
        assert len(asked) == 2  # n2 a member, n3 not asked again yet
        now[0] = ASK_AGAIN_S + 1
        serving["10.0.0.3:19000"] = True  # n3 now serves the model
        found.op({"candidates": two})
        await asyncio.sleep(0.01)
        assert sorted(pool.members) == ["replica-n2", "replica-n3"]
        # n2 gone from discovery, n3 at another address: both retired, n3 joins again
        found.op({"candidates": [{"node_id": "n3", "agent": "10.0.0.9:19000"}]})
        serving["10.0.0.9:19000"] = True
        await asyncio.sleep(0.01)
        assert pool.retired == ["replica-n2", "replica-n3"]
        assert {k: m.agent for k, m in pool.members.items()} == {
            "replica-n3": "10.0.0.9:19000"}
        assert found.agents == {"replica-n3": "10.0.0.9:19000"}
        await found.aclose()

    asyncio.run(run())


def test_a_bad_candidate_list_is_refused_by_name_and_changes_nothing() -> None:
    async def run() -> None:
        pool = Pool()
        found = Discovered(pool, lambda agent: None, Member)
        for bad, says in (({"candidates": "x"}, "'candidates' must be a list"),
                          ({"candidates": [{"node_id": 3, "agent": "a:1"}]}, "node_id"),
                          ({"candidates": [{"node_id": "n", "agent": "nope"}]},
                           "candidate 'n': agent is not host:port")):
            answer = found.op(bad)
            assert answer["ok"] is False and says in answer["error"], answer
        assert pool.members == {} and pool.retired == []

    asyncio.run(run())
