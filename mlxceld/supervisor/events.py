"""The worker lifecycle's words: why a worker exited (``ExitCause``), the events fed to
its state machine and the actions it returns (``states.py``, whose table maps one to the
other). Frozen values with no behaviour beyond reading them, as h11's ``_events.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from mlxceld.types import WorkerState

# Exit kinds after which the worker is not restarted: FAILED at once (see ExitCause.fatal).
FATAL_KINDS: Final = frozenset({"config"})
# What a fatal exit's FAILED reason ends with, after the exit's summary.
NOT_RESTARTED: Final = " (not restarted: the same start would fail the same way)"


@dataclass(frozen=True)
class ExitCause:
    """Why a worker process ended; classified elsewhere, consumed here."""

    kind: str  # "clean" | "signal" | "oom" | "exception" | "status" | "config" (options
    # refused: workers/options.py) | "unknown" | "spawn_failed" | "watchdog" (stopped by
    # the supervisor's watchdog: it had work and made no progress)
    summary: str  # one human line, e.g. "killed by SIGKILL (likely out of memory)"
    returncode: int | None = None

    @property
    def clean(self) -> bool:
        return self.kind == "clean"

    @property
    def fatal(self) -> bool:
        """A worker that refused its options or could not load what they name (``config``:
        ``workers/runtime.py``): another start fails the same way, so none is made."""
        return self.kind in FATAL_KINDS


# -- Input events -------------------------------------------------------------


@dataclass(frozen=True)
class StartRequested:
    """The user or the daemon wants the worker running; ``reason``, if given, is the
    STARTING state's (e.g. a worker group's restart: ``supervisor/groups.py``)."""

    reason: str = ""


@dataclass(frozen=True)
class StopRequested:
    """The user or the daemon wants the worker down, and to stay down; ``reason``, if
    given, is the STOPPING state's. ``at_once``: SIGKILL, not SIGTERM; ``within_s``:
    SIGTERM, and SIGKILL after this long rather than the stop timeout (a worker group's
    member whose peer failed: its work waits on that peer and cannot drain, but it may
    answer its requests first)."""

    reason: str = ""
    at_once: bool = False
    within_s: float | None = None


@dataclass(frozen=True)
class KillRequested:
    """A STOPPING worker is to be killed now, not at its stop timeout (a group's member
    stopped for failed health probes: hung, it would not act on SIGTERM)."""


@dataclass(frozen=True)
class AdoptedRunning:
    """The daemon restarted and found this worker still alive."""

    pid: int


@dataclass(frozen=True)
class Spawned:
    """The runner carried out ``SpawnProcess``."""

    pid: int


@dataclass(frozen=True)
class SpawnFailed:
    """The runner could not spawn the process; handled as a failed exit."""

    reason: str


@dataclass(frozen=True)
class BecameReady:
    """The worker's control channel answered health "ready"."""


@dataclass(frozen=True)
class HealthProbed:
    """A periodic liveness probe while RUNNING; ``stopping``: the worker is on its way out,
    not by our doing: it answered that it is stopping (as after an outside SIGTERM), or,
    not answering, it has written its exit record (its role is done; it tears down)."""

    ok: bool
    reason: str = ""
    stopping: bool = False


@dataclass(frozen=True)
class LoadAdvanced:
    """A starting worker's model load (or a download before it) has read more bytes than
    when it last said (``types.LoadProgress``): its start timeout counts again from now,
    so that a load of any size is bounded by its progress, not by its total."""


@dataclass(frozen=True)
class ProgressReported:
    """A running worker's progress, from a health probe's answer (``WorkerProgress``)."""

    busy: bool
    stalled_s: float  # how long it has had work without a step
    steps: int


@dataclass(frozen=True)
class ProcessExited:
    cause: ExitCause


Event = (
    StartRequested
    | StopRequested
    | KillRequested
    | AdoptedRunning
    | Spawned
    | SpawnFailed
    | BecameReady
    | HealthProbed
    | LoadAdvanced
    | ProgressReported
    | ProcessExited
)


# -- Output actions -----------------------------------------------------------


@dataclass(frozen=True)
class SpawnProcess:
    """Start the worker process; answer with ``Spawned`` or ``SpawnFailed``."""


@dataclass(frozen=True)
class SendSignal:
    signal: Literal["TERM", "KILL"]


@dataclass(frozen=True)
class Transitioned:
    """The state changed; for the log and the events table."""

    old: WorkerState
    new: WorkerState
    reason: str


Action = SpawnProcess | SendSignal | Transitioned
