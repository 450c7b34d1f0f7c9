"""Worker supervision: the sans-IO lifecycle state machine (``states``, exported here), the
runner that carries out its actions (``runner``), processes, health, logs, and the
``Supervisor`` over them all (``service``)."""

from mlxceld.supervisor.states import (
    Action,
    AdoptedRunning,
    BecameReady,
    Event,
    ExitCause,
    HealthProbed,
    KillRequested,
    Lifecycle,
    LoadAdvanced,
    ProcessExited,
    ProgressReported,
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
    "KillRequested",
    "Lifecycle",
    "LoadAdvanced",
    "ProcessExited",
    "ProgressReported",
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
