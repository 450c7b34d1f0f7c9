"""A node left on an old key is named by `mlxctl cluster nodes` before its traffic fails
(issue 16, secret rotation): two daemons on 127.0.0.1 and .2 hold a new key beside the
old one; only the first makes it its primary. The first polls the second at once (its
keyring changed) and learns from the inventory's ``key_id`` that the second still dials
with the old key: the row is ``key_stale`` and the table names the node and what to do.
Once the second makes the new key its primary too and the first removes the old one, the
first's view of the second is clean."""

from __future__ import annotations

import json
import secrets

from mlxceld.wire.secret import key_id

from helpers.cluster import POLL_WAIT_S, agent, by_address, start
from helpers.daemons import Daemons
from helpers.keys import secret_file
from helpers.waiting import wait_for


def test_a_node_that_missed_the_new_primary_is_named(daemons: Daemons) -> None:
    old, new = secrets.token_hex(16).encode(), secrets.token_hex(16).encode()
    old_id, new_id = key_id(old).hex(), key_id(new).hex()
    b = start(daemons, "127.0.0.2", old, name="b")
    a = start(daemons, "127.0.0.1", old, "--cluster-peers", agent(b), name="a")
    b_node = b.status()["daemon"]["node_id"]
    wait_for(lambda: by_address(a).get(agent(b), {}).get("key_id") == old_id, POLL_WAIT_S,
             "a sees b on the old key", every=0.2)
    for d in (a, b):
        assert d.ctl("secret", "install", str(secret_file(d.root, new))).returncode == 0
    assert a.ctl("secret", "use", new_id).returncode == 0

    row = wait_for(lambda: (r := by_address(a).get(agent(b), {})).get("key_stale") and r,
                   POLL_WAIT_S, "b shown stale on a", every=0.2)
    assert row["state"] == "reachable" and row["key_id"] == old_id
    shown = a.ctl("cluster", "nodes")
    assert shown.returncode == 0, shown.stderr
    assert f"key {new_id}" in shown.stdout.splitlines()[0]
    assert (f"node {b_node} ({agent(b)}) dials with key {old_id}, this node with {new_id}: "
            "it missed a secret rotation") in shown.stdout
    body = json.loads(a.ctl("cluster", "nodes", "--json").stdout)
    assert body["key_id"] == new_id

    assert b.ctl("secret", "use", new_id).returncode == 0
    assert a.ctl("secret", "remove", old_id).returncode == 0  # a repolls b at once
    wait_for(lambda: (r := by_address(a).get(agent(b), {})).get("key_id") == new_id
             and r.get("key_stale") is False, POLL_WAIT_S, "b current on a", every=0.2)
    assert f"{old_id}, this node" not in a.ctl("cluster", "nodes").stdout
    assert new.decode() not in a.stderr() + b.stderr()
