"""A worker ended by the kernel's OOM killer is labelled an out-of-memory kill, from the
memory cgroup's own counter: the daemon runs in a child memory cgroup with a limit (no
swap) and an echo worker fills memory past it. Needs root and a writable memory cgroup
(v1 ``memory.limit_in_bytes`` or v2 ``memory.max``); skipped elsewhere, with the reason.
The label's other half, a kill -9 by hand that is not an OOM kill, is in
test_supervision.py."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.daemons import FAST_POLICY, Daemons
from helpers.waiting import wait_for

LIMIT_MIB = 320  # the daemon and an echo worker need about 100 MiB together
HOG = FAST_POLICY + f"""
[workers.hog]
role = "echo"
options = {{ interval_s = 0.2, hog_mib = {4 * LIMIT_MIB} }}
"""


def _own_memory_cgroup() -> tuple[Path, dict[str, str]] | None:
    """Our memory cgroup's directory and the files that set a limit on a child, or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            here = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return here, {"memory.limit_in_bytes": "", "memory.memsw.limit_in_bytes": "",
                          "memory.swappiness": "0"}
        if hierarchy == "0":
            for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
                here = root / path.lstrip("/")
                if "memory" in (here / "cgroup.controllers").read_text(errors="replace") \
                        if (here / "cgroup.controllers").exists() else False:
                    return here, {"memory.max": "", "memory.swap.max": "0"}
    return None


@contextlib.contextmanager
def limited_cgroup(limit_mib: int) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup of our own needs root")
    found = _own_memory_cgroup()
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip("no writable memory cgroup (v1 memory controller or v2 memory.max)")
    parent, files = found
    child = parent / f"mxoom-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc.strerror}")
    try:
        limit = str(limit_mib << 20)
        for name, value in files.items():  # the limit before the limit with swap (v1)
            if (child / name).exists():
                try:
                    (child / name).write_text(value or limit)
                except OSError as exc:
                    pytest.skip(f"cannot set {child / name}: {exc.strerror}")
        yield child
    finally:
        procs = child / "cgroup.procs"
        for pid in procs.read_text().split() if procs.exists() else ():
            with contextlib.suppress(OSError):  # any left is moved back before the rmdir
                (parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            child.rmdir()


def test_a_worker_killed_by_the_oom_killer_is_labelled_out_of_memory(daemons: Daemons) -> None:
    with limited_cgroup(LIMIT_MIB) as cgroup:
        d = daemons.make(HOG)
        # the daemon joins the cgroup before it starts: its workers are born there
        d.start(prefix=("sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup)))
        assert str(d.pid) in (cgroup / "cgroup.procs").read_text().split()
        w = wait_for(lambda: (w := d.worker("hog"))["restarts"] >= 1 and w, 60,
                     "the hog worker killed and restarted")
        assert w["last_exit"] == "killed by the kernel OOM killer (out of memory)", w
        backoff = [e for e in d.events() if e["kind"] == "worker.backoff"
                   and e["subject"] == "hog"]
        assert backoff and backoff[0]["data"]["cause"] == "oom", backoff
        assert d.proc is not None and d.proc.poll() is None  # the daemon itself lives on
        d.terminate()
