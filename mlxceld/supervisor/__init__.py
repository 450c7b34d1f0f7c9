"""Worker supervision: the sans-IO lifecycle state machine (``states``) and the events it
takes and actions it gives (``events``), both exported here; the runner that carries out
its actions (``runner``), processes, health, logs, and the ``Supervisor`` over them all
(``service``)."""

from mlxceld.supervisor.events import (
    Action,
    AdoptedRunning,
    BecameReady,
    Event,
    ExitCause,
    HealthProbed,
    KillRequested,
    LoadAdvanced,
    ProcessExited,
    ProgressReported,
    SendSignal,
    Spawned,
    SpawnFailed,
    SpawnProcess,
    StartRequested,
    StopRequested,
    Transitioned,
)
from mlxceld.supervisor.states import Lifecycle, RestartPolicy
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
