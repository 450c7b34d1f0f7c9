"""The daemon's memory: one SQLite file (WAL) in the state dir."""

from mlxceld.state.db import SCHEMA_VERSION, open_db
from mlxceld.state.events import Event, EventLog
from mlxceld.state.keys import KeyInfo, KeyStore, parse_key_id
from mlxceld.state.node import Node, claim_node
from mlxceld.state.peers import PeerRow, PeersTable
from mlxceld.state.settings import Settings
from mlxceld.state.workers import WorkerRow, WorkersTable

__all__ = ["SCHEMA_VERSION", "Event", "EventLog", "KeyInfo", "KeyStore", "Node", "PeerRow",
           "PeersTable", "Settings", "WorkerRow", "WorkersTable", "claim_node", "open_db",
           "parse_key_id"]
