"""The daemon's memory: one SQLite file (WAL) in the state dir."""

from mlxceld.state.db import SCHEMA_VERSION, STATE_DB, open_db, open_state, state_errors
from mlxceld.state.drains import DrainRow, DrainsTable
from mlxceld.state.events import Event, EventLog
from mlxceld.state.keys import KeyInfo, KeyStore, parse_key_id
from mlxceld.state.liveness import LivenessRow, LivenessTable
from mlxceld.state.node import Node, claim_node
from mlxceld.state.peers import PeerRow, PeersTable
from mlxceld.state.rotations import RotationRow, RotationsTable
from mlxceld.state.settings import Settings
from mlxceld.state.workers import WorkerRow, WorkersTable

__all__ = ["SCHEMA_VERSION", "STATE_DB", "DrainRow", "DrainsTable", "Event", "EventLog",
           "KeyInfo", "KeyStore",
           "LivenessRow", "LivenessTable", "Node",
           "PeerRow", "PeersTable", "RotationRow", "RotationsTable", "Settings", "WorkerRow",
           "WorkersTable", "claim_node",
           "open_db", "open_state", "parse_key_id", "state_errors"]
