"""Boundary vocabulary: JSON shapes that cross a process or socket boundary."""

from __future__ import annotations

from typing import Any, Final, NotRequired, TypedDict

JSON = dict[str, Any]
MAX_PIPELINE_STAGES: Final = 64  # --pp-auto, [daemon] pp_auto, `mlxctl cluster plan|activate`


class WorkerBootstrap(TypedDict):
    """What the daemon writes to a new worker's stdin (never argv or environment).

    Secrets, when a role needs one, travel only here.
    """

    name: str
    role: str
    options: dict[str, Any]
    control_socket: str
    exit_record: str
    state_dir: str
    secret_hex: NotRequired[str]
    api_key: NotRequired[str]


class ExitRecord(TypedDict):
    """Written by a worker as it exits, so a daemon that adopted it learns why."""

    pid: int
    returncode: int
    kind: str
    summary: str
