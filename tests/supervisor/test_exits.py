"""Why a worker exited, read after the fact: wait status, log tail, exit record, OOM counter."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from mlxceld.supervisor.events import ExitCause
from mlxceld.supervisor.exits import classify, last_exception, oom_kill_count, read_exit_record

CHAINED = """\
=== 2025-01-01T00:00:00+0000 mlxceld: starting worker w1 (role echo) ===
Traceback (most recent call last):
  File "/srv/w.py", line 3, in load
    table["missing"]
KeyError: 'missing'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/srv/w.py", line 5, in load
    raise ValueError("model file is truncated")
ValueError: model file is truncated
    (a note, indented)
\t(and a tab-indented one)

"""


def test_clean_exit() -> None:
    assert classify(0, "", oom_kills_grew=None) == ExitCause("clean", "exited cleanly", 0)
    assert classify(0, CHAINED, oom_kills_grew=True).clean


@pytest.mark.parametrize("returncode", [-signal.SIGKILL, 128 + signal.SIGKILL])
@pytest.mark.parametrize(
    ("grew", "kind", "summary"),
    [
        (True, "oom", "killed by the kernel OOM killer (out of memory)"),
        (None, "signal", "killed by SIGKILL"),  # the kernel did not say: neither do we
        (False, "signal", "killed by SIGKILL"),
    ],
)
def test_sigkill_depends_on_the_oom_counter(returncode: int, grew: bool | None, kind: str,
                                            summary: str) -> None:
    cause = classify(returncode, "", oom_kills_grew=grew)
    assert cause == ExitCause(kind, summary, returncode)
    assert not cause.clean


def test_other_signals_are_named() -> None:
    assert classify(-signal.SIGTERM, CHAINED, oom_kills_grew=True) == ExitCause(
        "signal", "killed by SIGTERM", -signal.SIGTERM)
    assert classify(-signal.SIGSEGV, "", oom_kills_grew=None).summary == "killed by SIGSEGV"


def test_unknown_signal_number() -> None:
    assert classify(-200, "", oom_kills_grew=None) == ExitCause("signal", "killed by signal 200",
                                                               -200)


def test_plain_status_without_a_traceback() -> None:
    assert classify(3, "loading...\nbye\n", oom_kills_grew=None) == ExitCause(
        "status", "exited with status 3", 3)


def test_shell_style_status_other_than_sigkill_is_a_status() -> None:
    assert classify(128 + signal.SIGTERM, "", oom_kills_grew=None).kind == "status"


def test_status_with_a_traceback_is_an_exception() -> None:
    tail = "Traceback (most recent call last):\n  File \"x\", line 1\nRuntimeError: boom\n"
    assert classify(1, tail, oom_kills_grew=False) == ExitCause(
        "exception", "Python exception: RuntimeError: boom", 1)


def test_the_last_exception_of_a_chained_traceback_is_picked() -> None:
    assert last_exception(CHAINED) == "ValueError: model file is truncated"
    cause = classify(1, CHAINED, oom_kills_grew=None)
    assert cause.summary == "Python exception: ValueError: model file is truncated"


def test_last_exception_without_a_traceback() -> None:
    assert last_exception("") == ""
    assert last_exception("just a log line\nValueError: not after a traceback\n") == ""


def test_last_exception_is_capped() -> None:
    tail = "Traceback (most recent call last):\nValueError: " + "x" * 1000 + "\n"
    assert len(last_exception(tail)) == 300


# -- Exit records ----------------------------------------------------------------------------------


def write_record(path: Path, **record: object) -> Path:
    path.write_text(json.dumps(record))
    return path


def test_exit_record_of_the_matching_pid(tmp_path: Path) -> None:
    path = write_record(tmp_path / "w1.exit", pid=4242, returncode=1, kind="exception",
                        summary="Python exception: RuntimeError: boom")
    assert read_exit_record(path, 4242) == ExitCause(
        "exception", "Python exception: RuntimeError: boom", 1)


def test_exit_record_of_another_pid_is_ignored(tmp_path: Path) -> None:
    path = write_record(tmp_path / "w1.exit", pid=4242, returncode=0, kind="clean",
                        summary="exited cleanly")
    assert read_exit_record(path, 4243) is None


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff garbage",
        b"",
        b"[1, 2]",
        b'{"pid": 7}',
        b'{"pid": 7, "returncode": "one", "kind": "clean", "summary": ""}',
    ],
)
def test_unusable_exit_record_is_ignored(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "w1.exit"
    path.write_bytes(content)
    assert read_exit_record(path, 7) is None


def test_missing_exit_record(tmp_path: Path) -> None:
    assert read_exit_record(tmp_path / "absent.exit", 1) is None
    assert read_exit_record(tmp_path, 1) is None  # a directory: OSError, still None


# -- The OOM-kill counter -------------------------------------------------------------------------


def fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo.replace("ROOT", str(tmp_path)))
    return proc


def counter(directory: Path, name: str, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)


V2_EVENTS = "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n"  # memory.events
V1_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"  # memory.oom_control


def test_the_counter_of_cgroup_v2(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "0::/system.slice/mlxceld.service\n",
                     "30 23 0:26 / ROOT/cg rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    counter(tmp_path / "cg/system.slice/mlxceld.service", "memory.events", V2_EVENTS)
    assert oom_kill_count(proc) == 2


def test_the_counter_of_cgroup_v1_in_a_hybrid_host(tmp_path: Path) -> None:
    """Memory on v1 and an empty v2 hierarchy beside it (this is how the old bug read None)."""
    proc = fake_proc(tmp_path, "9:name=systemd:/\n4:memory:/box/42\n1:cpu,cpuacct:/\n0::/\n",
                     "31 23 0:28 / ROOT/v1/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
                     "35 23 0:32 / ROOT/v1/memory rw,relatime - cgroup cgroup rw,memory\n"
                     "41 23 0:38 / ROOT/unified rw,relatime - cgroup2 cgroup2 rw\n")
    (tmp_path / "unified").mkdir()  # no memory controller there: no memory.events
    counter(tmp_path / "v1/memory/box/42", "memory.oom_control", V1_CONTROL)
    assert oom_kill_count(proc) == 5


def test_a_mount_of_a_subtree_and_an_escaped_mount_point(tmp_path: Path) -> None:
    """A container's view: the mount shows /box as its root, in a path with a space."""
    proc = fake_proc(tmp_path, "0::/box/inner\n",
                     "30 23 0:26 /box ROOT/my\\040cg rw - cgroup2 cgroup2 rw\n")
    counter(tmp_path / "my cg/inner", "memory.events", V2_EVENTS)
    assert oom_kill_count(proc) == 2


@pytest.mark.parametrize(
    ("cgroup", "mountinfo"),
    [
        ("0::/elsewhere\n", "30 23 0:26 /box ROOT/cg rw - cgroup2 cgroup2 rw\n"),  # not shown
        ("0::/\n", ""),  # not mounted
        ("4:cpu:/x\n", "35 23 0:32 / ROOT/cg rw - cgroup cgroup rw,cpu\n"),  # no memory
        ("0::/\n", "30 23 0:26 / ROOT/cg rw - cgroup2 cgroup2 rw\n"),  # no counter file
        ("garbage", "garbage without the separator\n"),
    ],
)
def test_no_counter_reads_none(tmp_path: Path, cgroup: str, mountinfo: str) -> None:
    (tmp_path / "cg").mkdir()
    (tmp_path / "box").mkdir()
    assert oom_kill_count(fake_proc(tmp_path, cgroup, mountinfo)) is None


def test_no_proc_reads_none(tmp_path: Path) -> None:
    assert oom_kill_count(tmp_path / "absent") is None  # macOS


def test_this_hosts_counter_is_read_where_its_cgroup_exposes_one() -> None:
    """The counter the kernel keeps for our cgroup, found the plain way (cgroupfs at
    /sys/fs/cgroup), must be what ``oom_kill_count`` reads; the OOM label depends on it."""
    proc = Path("/proc/self/cgroup")
    if not proc.exists():
        pytest.skip("no /proc/self/cgroup: not Linux, so no OOM-kill counter to read")
    candidates = []
    for line in proc.read_text().splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.lstrip("/")
        if hierarchy == "0":
            candidates += [Path("/sys/fs/cgroup") / relative / "memory.events",
                           Path("/sys/fs/cgroup/unified") / relative / "memory.events"]
        elif "memory" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/memory") / relative / "memory.oom_control")
    exposed = [c for c in candidates if c.exists() and "oom_kill " in c.read_text()]
    if not exposed:
        pytest.skip(f"this host's cgroup exposes no oom_kill counter (looked at "
                    f"{', '.join(map(str, candidates)) or 'nothing: no cgroup lines'})")
    before = int(exposed[0].read_text().split("oom_kill ")[1].split()[0])
    count = oom_kill_count()
    after = int(exposed[0].read_text().split("oom_kill ")[1].split()[0])
    assert count is not None, f"{exposed[0]} holds a counter but oom_kill_count() read None"
    assert before <= count <= after
