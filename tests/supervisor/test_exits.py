"""Why a worker exited, read after the fact: wait status, log tail, exit record, OOM counter."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from mlxceld.supervisor.exits import classify, last_exception, oom_kill_count, read_exit_record
from mlxceld.supervisor.states import ExitCause

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
        (None, "oom", "killed by SIGKILL (likely out of memory)"),
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


def test_oom_kill_count_is_an_int_or_none() -> None:
    count = oom_kill_count()
    assert count is None or (isinstance(count, int) and count >= 0)
