"""What a daemon's state is at its start: the database, this node's identity in it and the
event log (trimmed); with ``reset`` (``mlxceld --reset-state``) a damaged database is moved
aside first (``db.open_state``), and the new node says so as an error in the log and as a
``state.reset`` event naming where the old file went."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import sqlite_utils

from mlxceld.state.db import open_state
from mlxceld.state.events import EventLog
from mlxceld.state.node import Node, claim_node

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartState:
    db: sqlite_utils.Database
    node: Node
    events: EventLog


def start_state(path: Path, *, reset: bool) -> StartState:
    db, aside = open_state(path, reset=reset)
    node = claim_node(db)
    events = EventLog(db)
    events.trim()
    if aside is not None:
        message = (f"the state database was damaged and is moved aside to {aside}; this "
                   f"daemon starts over as a new node, {node.node_id}, without history, "
                   "worker records or installed secrets (a configured secret is adopted again)")
        log.error("%s", message)
        events.append("state.reset", "daemon", message, moved_to=str(aside),
                      node_id=node.node_id)
    elif reset:
        log.warning("--reset-state: the state database %s is sound; it is kept", path)
    return StartState(db, node, events)
