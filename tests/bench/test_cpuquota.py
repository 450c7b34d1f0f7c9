"""bench/cpuquota.py, the slow host's CPU quota in bench/plan_speed_measured.py: a process
started through ``wrap`` runs in the fresh cgroup from its start, its children too, the
quota holds it back (the kernel counts throttled periods), and ``remove`` leaves no cgroup.
Where no cgroup can be made (not root, CI) only the refusals run; as root, an unprivileged
user's probe says why it cannot make one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from helpers.benches import BENCH, bench_module


@pytest.fixture(scope="module")
def cpuquota() -> Iterator[ModuleType]:
    with bench_module("cpuquota") as module:
        yield module


def cgroup_of(pid: int, version: int) -> str:
    """The cpu controller's cgroup of ``pid`` (``/proc/PID/cgroup``)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == 2 and controllers == "") or "cpu" in controllers.split(","):
            return path
    raise AssertionError(f"no cpu cgroup for {pid}")


def test_a_fraction_outside_one_cpu_is_refused(cpuquota: ModuleType) -> None:
    for fraction in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="fraction in"):
            cpuquota.CpuGroup.make(f"mxtest-{os.getpid()}", fraction)


def test_a_wrapped_process_and_its_child_run_held_in_the_group(cpuquota: ModuleType) -> None:
    if (why := cpuquota.probe()) is not None:
        pytest.skip(f"no cgroup CPU quota here: {why}")
    group = cpuquota.CpuGroup.make(f"mxtest-{os.getpid()}", 0.1)
    try:
        assert group.path.is_dir() and group.fraction == 0.1
        quota = ((group.path / "cpu.max").read_text().split() if group.version == 2 else
                 [(group.path / f"cpu.cfs_{k}_us").read_text().strip()
                  for k in ("quota", "period")])
        assert quota == ["1000", "10000"]
        weight = (group.path / ("cpu.weight" if group.version == 2 else "cpu.shares"))
        assert int(weight.read_text()) == (100 if group.version == 2 else 1024) * 100
        # a parent that starts a child, both spinning for 0.5 s, then print their pids
        spin = ("import os, subprocess, sys, time\n"
                "c = subprocess.Popen([sys.executable, '-c', 'import time\\n"
                "t = time.monotonic() + 0.5\\nwhile time.monotonic() < t: pass\\n"
                "time.sleep(30)'])\n"
                "t = time.monotonic() + 0.5\nwhile time.monotonic() < t: pass\n"
                "print(os.getpid(), c.pid, flush=True)\ntime.sleep(30)\n")
        proc = subprocess.Popen(group.wrap([sys.executable, "-c", spin]),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            parent, child = (int(p) for p in proc.stdout.readline().split())
            assert parent == proc.pid  # the shell exec'd it: the same pid
            name = f"/{group.path.name}"
            assert cgroup_of(parent, group.version).endswith(name)
            assert cgroup_of(child, group.version).endswith(name)
            assert cgroup_of(os.getpid(), group.version) != cgroup_of(parent, group.version)
            assert sorted(group.pids()) == sorted([parent, child])
            assert group.throttled() > 0  # 1 s of spinning against 1 ms in each 10
        finally:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        # the child is left (its parent killed): remove() kills it by pid from the list
    finally:
        group.remove()
    assert not group.path.exists()


def test_an_unprivileged_probe_says_why_it_cannot(cpuquota: ModuleType) -> None:
    if os.geteuid() != 0 or cpuquota.probe() is not None:
        pytest.skip("needs root and a writable cpu controller, to see a user refused")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
    if subprocess.run([*nobody, "-c", "pass"], capture_output=True, timeout=60, cwd="/",
                      check=False).returncode != 0:
        pytest.skip(f"user 65534 cannot run {sys.executable}")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import cpuquota; "
             "print(cpuquota.probe())")
    # A copy that user can read: the checkout may sit below a directory only root enters
    # (CI's clean clone in a 0700 temporary directory).
    readable = Path(tempfile.mkdtemp(prefix="mxquota-"))
    try:
        readable.chmod(0o755)
        shutil.copy(BENCH / "cpuquota.py", readable / "cpuquota.py")
        (readable / "cpuquota.py").chmod(0o644)
        out = subprocess.run([*nobody, "-c", probe, str(readable)], cwd="/",
                             capture_output=True, text=True, timeout=60, check=False)
    finally:
        shutil.rmtree(readable, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    why = out.stdout.strip()
    _, parent = cpuquota.hierarchy()
    assert why.startswith(f"cannot make the cgroup {parent}/mxprobe-")
    assert why.endswith("Permission denied")
