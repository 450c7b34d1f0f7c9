"""Starting a worker process from its typed spec, and recognising one after a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from mlxceld.errors import WorkerError
from mlxceld.logformat import LogFormat
from mlxceld.roles import ROUTER, STAGE, STAGE_TP, TP
from mlxceld.roles.options import WorkerOptions, options_json
from mlxceld.supervisor import channel, logfiles
from mlxceld.supervisor.ops import Health
from mlxceld.supervisor.states import RestartPolicy
from mlxceld.types import WorkerBootstrap

# Never hand these to a child: secrets travel on the bootstrap pipe only.
SECRET_ENV = re.compile(r"SECRET|API_KEY|PASSWORD|TOKEN", re.IGNORECASE)
# The service manager's channel is the daemon's alone (systemd NotifyAccess=main): a
# worker that inherited NOTIFY_SOCKET could report READY or ping the watchdog for it.
SERVICE_MANAGER_ENV = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"})
# The Hugging Face token (the daemon's HF_TOKEN or HUGGING_FACE_HUB_TOKEN), for the
# workers that may download a model named by its repo id (a stage its shards, a router
# and its tensor-parallel ranks mlx-lm's whole model; models/fetch.py) and no others: in
# their bootstrap, on stdin, as the cluster secret travels; never in a child's
# environment.
DOWNLOAD_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
DOWNLOADERS = frozenset({ROUTER, STAGE, TP, STAGE_TP})
CREATE_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one worker; built by the daemon (``mlxceld.daemon.roster``).
    The role is the options' (``workers/options.py``): one cannot be given without the
    other."""

    name: str
    state_dir: Path
    options: WorkerOptions
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    secret: bytes | None = field(default=None, repr=False)  # the primary cluster secret
    accepted: tuple[bytes, ...] = field(default=(), repr=False)  # the others it accepts
    api_key: str | None = field(default=None, repr=False)
    log_format: LogFormat = "text"  # its log lines (logformat.py), as the daemon's
    # The workers that live and die together (a tensor-parallel group's ranks): one's
    # failure restarts them all (supervisor/groups.py). None: on its own.
    group: str | None = None

    @property
    def role(self) -> str:
        return self.options.role

    @property
    def control_socket(self) -> Path:
        return self.state_dir / "workers" / f"{self.name}.sock"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "logs" / f"{self.name}.log"

    @property
    def exit_record(self) -> Path:
        return self.state_dir / "workers" / f"{self.name}.exit"

    def describe(self) -> dict[str, Any]:
        """The spec as stored in SQLite: no secret, only whether there is one."""
        return {"name": self.name, "role": self.role, "options": options_json(self.options),
                "has_secret": self.secret is not None, "has_api_key": self.api_key is not None,
                "group": self.group}

    def bootstrap(self) -> WorkerBootstrap:
        boot: WorkerBootstrap = {
            "name": self.name, "role": self.role, "options": options_json(self.options),
            "control_socket": str(self.control_socket), "exit_record": str(self.exit_record),
            "state_dir": str(self.state_dir),
        }
        if self.secret is not None:
            boot["secret_hex"] = self.secret.hex()
            if self.accepted:
                boot["accepted_hex"] = [s.hex() for s in self.accepted]
        if self.api_key is not None:
            boot["api_key"] = self.api_key
        if self.log_format != "text":
            boot["log_format"] = self.log_format
        token = next((t for v in DOWNLOAD_ENV if (t := os.environ.get(v))), None)
        if token and self.role in DOWNLOADERS:
            boot["hf_token"] = token
        return boot


def child_environment() -> dict[str, str]:
    """The daemon's environment less its secrets (a Hugging Face token too: see
    ``DOWNLOAD_ENV``) and the service manager's channel."""
    env = {k: v for k, v in os.environ.items()
           if not SECRET_ENV.search(k) and k not in SERVICE_MANAGER_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def spawn(spec: WorkerSpec) -> asyncio.subprocess.Process:
    """Start the worker in its own session, stdout+stderr on its log, the spec on stdin."""
    for d in (spec.control_socket.parent, spec.log_path.parent):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_fd = logfiles.open_for_worker(spec.log_path, f"starting worker {spec.name} "
                                      f"(role {spec.role})", spec.log_format)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mlxceld.workers", "--role", spec.role, "--name", spec.name,
            stdin=asyncio.subprocess.PIPE, stdout=log_fd, stderr=log_fd,
            start_new_session=True, env=child_environment(), cwd=spec.state_dir,
        )
    except OSError as exc:
        raise WorkerError(f"worker {spec.name!r} could not be started: {exc}",
                          hint=f"check {sys.executable} and the state dir") from exc
    finally:
        os.close(log_fd)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec.bootstrap()).encode())
    with contextlib.suppress(ConnectionError):
        await proc.stdin.drain()
    proc.stdin.close()
    return proc


def create_time(pid: int) -> float | None:
    """The process's start time, or None if it is gone or a zombie."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(p.create_time())
    except psutil.Error:
        return None


def is_same_process(pid: int, recorded_create_time: float | None) -> bool:
    """True when ``pid`` is alive and started when we recorded (not a reused pid)."""
    now = create_time(pid)
    return (now is not None and recorded_create_time is not None
            and abs(now - recorded_create_time) < CREATE_TIME_TOLERANCE_S)


async def confirm_adoptable(spec: WorkerSpec, pid: int, recorded_create_time: float | None) -> bool:
    """A running worker from a previous daemon is ours if pid, start time and channel agree."""
    if not is_same_process(pid, recorded_create_time):
        return False
    try:
        reply = await channel.call(spec.control_socket, Health())
    except WorkerError:
        return False
    return reply.get("pid") == pid and reply.get("name") == spec.name


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the worker's whole process group (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None
