"""Boundary vocabulary: JSON shapes that cross a process or socket boundary."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, NotRequired, TypedDict

JSON = dict[str, Any]
# A peer that sends nothing (not even a pong) for this long is silent: net/liveness.py,
# [serve] stage_silence_s.
DEFAULT_SILENCE_S: Final = 3.0
MAX_PIPELINE_STAGES: Final = 64  # --pp-auto, [daemon] pp_auto, `mlxctl cluster plan|activate`
MAX_DRAIN_DEADLINE_S: Final = 7 * 24 * 3600.0  # the longest `mlxctl drain --deadline`


class WorkerState(StrEnum):
    """The supervisor's view of a worker (its lifecycle: ``supervisor.states``), as
    stored and as `mlxctl status` shows it."""

    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    EXITED = "exited"
    FAILED = "failed"


class WorkerHealth(StrEnum):
    """A worker's own word on itself: ``state`` in its control channel's ``health`` answer.
    (The supervisor's view of a worker is ``WorkerState``.)"""

    STARTING = "starting"  # its role is getting ready (binding, loading a model)
    READY = "ready"  # it does its work
    STOPPING = "stopping"  # told to stop


class WorkerBootstrap(TypedDict):
    """What the daemon writes to a new worker's stdin (never argv or environment).

    Secrets, when a role needs one, travel only here.
    """

    name: str
    role: str
    options: dict[str, object]  # the role's options (workers/options.py), read once on entry
    control_socket: str
    exit_record: str
    state_dir: str
    secret_hex: NotRequired[str]  # the primary cluster secret: what the worker dials with
    accepted_hex: NotRequired[list[str]]  # the others it accepts (a rotation's overlap)
    api_key: NotRequired[str]


class WorkerKeys(TypedDict):
    """A worker's keyring by key id (hex), in its ``health`` answer: never a secret."""

    primary: str
    ids: list[str]


class ExitRecord(TypedDict):
    """Written by a worker as it exits, so a daemon that adopted it learns why."""

    pid: int
    returncode: int
    kind: str
    summary: str


class WorkerProgress(TypedDict):
    """A worker's progress, in its ``health`` answer (``progress``) where its role does
    steps of work (the stage). The supervisor's watchdog restarts a worker that has work
    (``busy``) but has made no step for ``RestartPolicy.stall_timeout_s``."""

    steps: int  # steps done since the worker started
    last_step_at: float | None  # wall-clock time of the last step; None: none yet
    busy: bool  # it has work: something received and not yet done
    stalled_s: float  # how long it has had work without a step (0 when not busy)
