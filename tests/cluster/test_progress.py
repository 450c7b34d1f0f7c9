"""``CoordinatorRound.progress``: each peer's step, as `mlxctl cluster activate` shows it
(sans-IO: messages in, no sockets, no clock)."""

from __future__ import annotations

from mlxceld.cluster.assignment.coordinator_round import CoordinatorRound

PEERS = ("a:1", "b:2")


def states(r: CoordinatorRound) -> dict[str, str]:
    return {p: s for p, (s, _) in r.progress().items()}


def test_each_step_of_a_round_that_succeeds() -> None:
    r = CoordinatorRound(3, PEERS, started=0.0)
    r.start()
    assert states(r) == {"a:1": "offered", "b:2": "offered"}
    r.on_preparing("a:1", 1)
    assert states(r) == {"a:1": "loading", "b:2": "offered"}
    r.on_accepted("a:1", 2)
    r.on_preparing("b:2", 2)
    assert states(r) == {"a:1": "prepared", "b:2": "loading"}
    r.on_accepted("b:2", 3)
    r.on_committed("a:1", 4)
    assert states(r) == {"a:1": "committed", "b:2": "prepared"}
    r.on_committed("b:2", 4)
    r.on_active("b:2", 5)
    assert states(r) == {"a:1": "committed", "b:2": "active"}
    r.on_active("a:1", 5)
    assert r.progress() == {"a:1": ("active", ""), "b:2": ("active", "")}


def test_a_refusal_names_its_peer_and_the_others_read_aborted() -> None:
    r = CoordinatorRound(4, PEERS, started=0.0)
    r.start()
    r.on_accepted("a:1", 1)
    r.on_refused("b:2", "not_a_peer: start it with --pp-peer")
    assert r.progress() == {"a:1": ("aborted", "another peer failed"),
                            "b:2": ("failed", "refused: not_a_peer: start it with --pp-peer")}


def test_a_deadline_fails_the_peers_that_were_late() -> None:
    r = CoordinatorRound(5, PEERS, started=0.0, push_s=20.0, commit_window_s=10.0)
    r.start()
    r.on_accepted("a:1", 1)
    r.handle_timer(10.0)
    assert r.progress() == {"a:1": ("aborted", "another peer failed"),
                            "b:2": ("failed", "did not accept in time")}
