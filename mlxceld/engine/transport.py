"""Which ``mx.distributed`` backend a tensor-parallel group forms over: the ring or JACCL.

mlx offers two backends for a group of Macs: the ring (TCP sockets, any network,
always built) and JACCL (RDMA over Thunderbolt, low latency: what makes tensor
parallelism pay across Macs). JACCL runs only where every host has it, so the choice
is a pure function of what each rank's host reports (``choose_transport``), with the
ring as the fallback and a short reason either way, shown by ``mlxctl status``.

What a Mac needs for JACCL (Apple's TN3205 and mlx's distributed guide):

- Apple silicon with Thunderbolt 5, on macOS 26.2 or later;
- RDMA over Thunderbolt enabled once, in macOS Recovery: Utilities > Terminal,
  ``rdma_ctl enable``, then restart; ``ibv_devices`` then lists one device per
  Thunderbolt port;
- an mlx whose build has the JACCL backend (``mx.distributed.is_available("jaccl")``);
- a Thunderbolt cable between every pair of hosts of the group (a full mesh).

``probe_host`` gathers one host's report (bounded by ``PROBE_S``, never raises). The
one-host group (``--tp-size``) probes its host and reports the choice, always the ring:
its ranks share one machine, and JACCL joins separate Macs. A group across hosts
(``--tp-peers``): each rank host's daemon probes itself in a child process
(``probe_in_child``) and sends its report with its ``tensor_reserved`` answer; rank 0's
daemon chooses over all of them at each formation and ``mlxctl status`` shows it. No
host here reports a Thunderbolt link between two hosts yet (which Thunderbolt port
reaches which host is not read), so across hosts the choice is the ring, named why; the
ring is what forms. Importing this module does
not import mlx; the probe does, to ask what mlx was built with.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Literal

Backend = Literal["ring", "jaccl"]
MIN_MACOS: Final = (26, 2)  # RDMA over Thunderbolt, Apple's TN3205
PROBE_S: Final = 2.0  # the most ``ibv_devices`` may take
LINUX_RDMA: Final = Path("/sys/class/infiniband")  # where Linux lists RDMA devices


@dataclass(frozen=True)
class HostReport:
    """What one host says of its RDMA: its name, OS, mlx's build and devices."""

    host: str  # the host as the group names it (a node id or an address)
    system: str  # sys.platform: "darwin", "linux", ...
    macos: tuple[int, ...] | None  # the macOS version, None elsewhere (or unknown)
    jaccl: bool  # mlx was built with the JACCL backend
    rdma_devices: tuple[str, ...]  # RDMA devices found (ibv_devices' names)


@dataclass(frozen=True)
class TransportChoice:
    backend: Backend
    reason: str  # short, for a person: "no RDMA device on studio-2"

    def line(self) -> str:
        return f"{self.backend} ({self.reason})"


def choose_transport(reports: Sequence[HostReport],
                     links: Collection[frozenset[str]] = ()) -> TransportChoice:
    """JACCL when every host of the group can run it and every pair of distinct hosts
    is linked over Thunderbolt (``links``: the pairs that are); else the ring, and why:
    the first host (in rank order) that lacks something, or the first pair not linked."""
    if not reports:
        return TransportChoice("ring", "no hosts reported")
    for r in reports:
        if r.system != "darwin":
            return TransportChoice("ring", f"{_on(r, reports)} is not macOS ({r.system}); "
                                   "RDMA over Thunderbolt is a Mac's")
        if r.macos is None or r.macos < MIN_MACOS:
            said = ".".join(map(str, r.macos)) if r.macos else "an unknown version"
            return TransportChoice("ring", f"{_on(r, reports)} runs macOS {said}; RDMA "
                                   f"over Thunderbolt needs {_version(MIN_MACOS)} or later")
        if not r.jaccl:
            return TransportChoice("ring", f"mlx on {_on(r, reports)} was built without "
                                   "JACCL")
        if not r.rdma_devices:
            return TransportChoice("ring", f"no RDMA device on {_on(r, reports)} (enable it "
                                   "in macOS Recovery: rdma_ctl enable)")
    hosts = list(dict.fromkeys(r.host for r in reports))
    if len(hosts) == 1:
        return TransportChoice("ring", f"all {len(reports)} ranks on one host; JACCL joins "
                               "separate Macs")
    for i, a in enumerate(hosts):
        for b in hosts[i + 1:]:
            if frozenset((a, b)) not in links:
                return TransportChoice("ring", f"{a} and {b} are not linked over "
                                       "Thunderbolt")
    return TransportChoice("jaccl", f"RDMA over Thunderbolt between all {len(hosts)} hosts")


CHILD_S: Final = 20.0  # a probe in a child process: mlx's import, then ``PROBE_S``
_CHILD: Final = ("import json, sys; from mlxceld.engine.transport import probe_host, "
                 "report_json; print(json.dumps(report_json(probe_host('this host'))))")
MAX_DEVICES: Final = 32


def report_json(r: HostReport) -> dict[str, object]:
    """``r`` as a rank host sends it (its ``host`` is named by the asker)."""
    return {"system": r.system, "macos": list(r.macos) if r.macos else None,
            "jaccl": r.jaccl, "devices": list(r.rdma_devices)}


def report_from_json(host: str, value: object) -> HostReport:
    """A report as ``report_json`` wrote it, from ``host``; ``ValueError`` naming the
    field that is not as written."""
    if not isinstance(value, dict) or set(value) != {"system", "macos", "jaccl", "devices"}:
        raise ValueError("a host report has exactly system, macos, jaccl and devices")
    system, macos, jaccl, devices = (value["system"], value["macos"], value["jaccl"],
                                     value["devices"])
    if not isinstance(system, str) or not 0 < len(system) <= 32:
        raise ValueError("a host report's 'system' must be a platform name")
    if macos is not None and (not isinstance(macos, list) or not 0 < len(macos) <= 4 or not all(
            type(v) is int and 0 <= v < 1000 for v in macos)):
        raise ValueError("a host report's 'macos' must be null or a version, e.g. [26, 2]")
    if type(jaccl) is not bool:
        raise ValueError("a host report's 'jaccl' must be true or false")
    if not isinstance(devices, list) or len(devices) > MAX_DEVICES or not all(
            isinstance(d, str) and 0 < len(d) <= 64 for d in devices):
        raise ValueError(f"a host report's 'devices' must list at most {MAX_DEVICES} names")
    return HostReport(host, system, tuple(macos) if macos else None, jaccl, tuple(devices))


def probe_in_child(host: str, *, timeout_s: float = CHILD_S) -> HostReport:
    """``probe_host`` in a child process (a daemon never imports mlx: its threads left at
    exit abort it); a child that fails or outlasts ``timeout_s`` reports nothing: no
    JACCL, no device (the ring then)."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        return replace(report_from_json(host, json.loads(done.stdout)), host=host)
    except (OSError, subprocess.SubprocessError, ValueError):
        return HostReport(host, sys.platform, _macos_version() if sys.platform == "darwin"
                          else None, False, ())


def probe_host(host: str, *, timeout_s: float = PROBE_S) -> HostReport:
    """This host's report; whatever cannot be told reads as absent (never raises)."""
    system = sys.platform
    macos = _macos_version() if system == "darwin" else None
    return HostReport(host=host, system=system, macos=macos, jaccl=_mlx_has_jaccl(),
                      rdma_devices=rdma_devices(system, timeout_s))


def _on(r: HostReport, reports: Sequence[HostReport]) -> str:
    """The host as a message names it: "this host" when every rank is on it."""
    return "this host" if all(o.host == r.host for o in reports) else r.host


def _version(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def _macos_version() -> tuple[int, ...] | None:
    try:
        text = platform.mac_ver()[0]
        return tuple(int(p) for p in text.split(".")) if text else None
    except (ValueError, OSError):
        return None


def _mlx_has_jaccl() -> bool:
    try:
        import mlx.core as mx

        return bool(mx.distributed.is_available(backend="jaccl"))
    except Exception:  # an mlx without the argument, or none at all: no JACCL
        return False


def rdma_devices(system: str, timeout_s: float) -> tuple[str, ...]:
    """The RDMA devices: ``ibv_devices``' on a Mac (within ``timeout_s``), the kernel's
    list elsewhere."""
    if system != "darwin":
        try:
            return tuple(sorted(os.listdir(LINUX_RDMA)))
        except OSError:
            return ()
    tool = shutil.which("ibv_devices")
    if tool is None:
        return ()
    try:
        out = subprocess.run([tool], capture_output=True, text=True, timeout=timeout_s,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return ()
    return parse_ibv_devices(out.stdout) if out.returncode == 0 else ()


def parse_ibv_devices(text: str) -> tuple[str, ...]:
    """The device names of ``ibv_devices``' table (a header, a rule, a row per device)."""
    names = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] == "device" or set(words[0]) <= {"-"}:
            continue
        names.append(words[0])
    return tuple(names)
