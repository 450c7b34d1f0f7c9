"""The ``node`` table: this daemon's identity, kept across restarts."""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass

import sqlite_utils

from mlxceld import __version__


@dataclass(frozen=True)
class Node:
    node_id: str
    created_at: float
    hostname: str


def claim_node(db: sqlite_utils.Database) -> Node:
    """Load this node's identity (creating it on first start) and record this daemon's run."""
    table = db.table("node")
    now = time.time()
    rows = list(table.rows_where("id = 1"))
    if rows:
        row = rows[0]
        table.update(1, {"version": __version__, "daemon_pid": os.getpid(), "started_at": now})
        return Node(row["node_id"], row["created_at"], row["hostname"])
    hostname = socket.gethostname()
    node = Node(f"{hostname.split('.')[0]}-{secrets.token_hex(3)}", now, hostname)
    table.insert({"id": 1, "node_id": node.node_id, "created_at": now, "version": __version__,
                  "hostname": hostname, "daemon_pid": os.getpid(), "started_at": now})
    return node
