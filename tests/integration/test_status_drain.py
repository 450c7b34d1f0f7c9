"""`mlxctl status` on a single node (no cluster) that is drained says so: before, its
drain (which refuses every new request, across restarts) was shown nowhere but
`GET /v1/drains`, and the status read as if all were well."""

from __future__ import annotations

import json

from helpers.daemons import Daemons


def test_a_drained_single_node_shows_its_drain_in_status(daemons: Daemons) -> None:
    d = daemons.make().start()
    node = d.status()["daemon"]["node_id"]
    assert d.ctl("drain", node).returncode == 0
    text = d.ctl("status")
    assert text.returncode == 0, text.stderr
    assert f"drain: node {node} drained since" in text.stdout
    body = json.loads(d.ctl("status", "--json").stdout)
    assert body["pipeline"] is None  # no cluster view: the drains are the status's own
    assert [(r["node_id"], r["state"]) for r in body["drains"]] == [(node, "drained")]
    assert d.ctl("undrain").returncode == 0
    assert "drain:" not in d.ctl("status").stdout
    assert json.loads(d.ctl("status", "--json").stdout)["drains"] == []
