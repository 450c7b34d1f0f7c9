"""The candidate table over a real SQLite file: proposals, poll results, freshness, restart."""

from __future__ import annotations

from typing import Any

import sqlite_utils

from mlxceld.discovery.candidates import CandidateTable
from mlxceld.state import PeersTable

T0 = 1_767_225_600


def record(node: str = "host-b", ts: int = T0, kid: str = "ab" * 8) -> dict[str, str]:
    return {"v": "1", "ver": "0.1.0", "cluster": "c", "node": node, "addr": "10.0.0.2:19000",
            "ts": str(ts), "nonce": "00" * 16, "kid": kid, "mac": "00" * 32}


def inventory(node: str = "host-b") -> dict[str, Any]:
    return {"t": "inventory", "node": node, "version": "0.1.0",
            "platform": {"system": "linux", "machine": "x86_64"}, "memory_total": 64 << 30,
            "memory_available": 60 << 30, "model": None, "ports": [4001], "agent": "0.0.0.0:1"}


def test_static_peers_then_poll_results(db: sqlite_utils.Database) -> None:
    table = CandidateTable(PeersTable(db), node_id="me")
    added: list[str] = []
    table.on_added = added.append
    table.sync_static(["10.0.0.2:1", "10.0.0.3:1"], T0)
    assert added == ["10.0.0.2:1", "10.0.0.3:1"]
    assert [r["state"] for r in table.snapshot()] == ["discovered", "discovered"]
    table.answered("10.0.0.2:1", inventory(), "ab" * 8, T0 + 1)
    table.failed("10.0.0.3:1", "refused", "unknown_key_id: no", T0 + 1)
    b, c = table.snapshot()
    assert (b["state"], b["node_id"], b["memory_total"], b["key_id"], b["last_seen"]) == (
        "reachable", "host-b", 64 << 30, "ab" * 8, T0 + 1)
    assert (c["state"], c["error"], c["last_seen"]) == ("refused", "unknown_key_id: no", None)
    assert [r.address for r in table.reachable()] == ["10.0.0.2:1"]
    table.failed("10.0.0.2:1", "unreachable", "unreachable: gone", T0 + 30)
    b = table.snapshot()[0]
    assert (b["state"], b["memory_total"], b["last_seen"]) == ("unreachable", 64 << 30, T0 + 1)

    again = CandidateTable(PeersTable(db), node_id="me")  # a restarted daemon
    assert again.snapshot() == table.snapshot()
    again.sync_static(["10.0.0.3:1"], T0 + 40)
    assert again.addresses() == ["10.0.0.3:1"]
    assert CandidateTable(PeersTable(db)).addresses() == ["10.0.0.3:1"]


def test_an_answer_from_ourselves_removes_the_row(db: sqlite_utils.Database) -> None:
    table = CandidateTable(PeersTable(db), node_id="me")
    table.propose_static("127.0.0.1:19000", T0)
    table.answered("127.0.0.1:19000", inventory("me"), "ab" * 8, T0)
    assert len(table) == 0 and PeersTable(db).all() == []


def test_mdns_records_newest_wins_and_expire(db: sqlite_utils.Database) -> None:
    table = CandidateTable(PeersTable(db), node_id="me")
    table.propose_record(record(ts=T0), "10.0.0.2:19000", T0)
    table.propose_record(record(ts=T0 - 5, kid="cd" * 8), "10.0.0.2:19000", T0 + 1)  # older
    row = table.get("10.0.0.2:19000")
    assert row is not None and (row.source, row.record_ts, row.key_id) == ("mdns", T0, "ab" * 8)
    table.propose_record(record(ts=T0 + 20), "10.0.0.2:19000", T0 + 20)
    assert table.expire(T0 + 80) == []  # 60 s from the newest ts is still fresh
    assert table.expire(T0 + 81) == ["10.0.0.2:19000"]
    assert len(table) == 0
    table.propose_record(record("me"), "10.0.0.9:1", T0)  # our own record
    assert len(table) == 0


def test_a_node_that_moves_keeps_one_row(db: sqlite_utils.Database) -> None:
    table = CandidateTable(PeersTable(db), node_id="me")
    table.propose_record(record(ts=T0), "10.0.0.2:19000", T0)
    table.propose_record(record(ts=T0 + 20), "10.0.0.7:19000", T0 + 20)
    assert table.addresses() == ["10.0.0.7:19000"]
    table.propose_record(record(ts=T0 + 10), "10.0.0.2:19000", T0 + 21)  # a late old record
    assert table.addresses() == ["10.0.0.7:19000"]


def test_static_rows_stay_static_and_never_expire(db: sqlite_utils.Database) -> None:
    table = CandidateTable(PeersTable(db), node_id="me")
    table.propose_static("10.0.0.2:19000", T0)
    table.propose_record(record(ts=T0), "10.0.0.2:19000", T0)
    row = table.get("10.0.0.2:19000")
    assert row is not None and (row.source, row.node_id) == ("static", "host-b")
    assert table.expire(T0 + 600) == []
