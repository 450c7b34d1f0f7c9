"""Worker supervision: the sans-IO lifecycle state machine (and, later, the process runner)."""

from mlxceld.supervisor.states import (
    Action,
    AdoptedRunning,
    BecameReady,
    Event,
    ExitCause,
    HealthProbed,
    Lifecycle,
    ProcessExited,
    RestartPolicy,
    SendSignal,
    Spawned,
    SpawnFailed,
    SpawnProcess,
    StartRequested,
    StopRequested,
    Transitioned,
)
from mlxceld.types import WorkerState

__all__ = [
    "Action",
    "AdoptedRunning",
    "BecameReady",
    "Event",
    "ExitCause",
    "HealthProbed",
    "Lifecycle",
    "ProcessExited",
    "RestartPolicy",
    "SendSignal",
    "SpawnFailed",
    "SpawnProcess",
    "Spawned",
    "StartRequested",
    "StopRequested",
    "Transitioned",
    "WorkerState",
]
