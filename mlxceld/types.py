"""Boundary vocabulary: JSON shapes that cross a process or socket boundary."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

JSON = dict[str, Any]


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
    secret_hex: NotRequired[str]
    api_key: NotRequired[str]


class ExitRecord(TypedDict):
    """Written by a worker as it exits, so a daemon that adopted it learns why."""

    pid: int
    returncode: int
    kind: str
    summary: str
