"""Per-worker log files on a real filesystem: banner, O_APPEND, rotation, tail, follow."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import pytest

from mlxceld.supervisor.logfiles import (
    READ_CHUNK,
    open_for_worker,
    read_from,
    rotate_if_needed,
    tail,
)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "w1.log"


def backup(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def test_open_for_worker_writes_the_banner_on_an_append_fd(log: Path) -> None:
    log.write_bytes(b"earlier run\n")
    fd = open_for_worker(log, "starting worker w1 (role echo)")
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND
        os.write(fd, b"hello\n")
    finally:
        os.close(fd)
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier run"
    assert lines[1].startswith("=== ")
    assert lines[1].endswith(" mlxceld: starting worker w1 (role echo) ===")
    assert lines[2] == "hello"


def test_open_for_worker_creates_the_file_0600(log: Path) -> None:
    os.close(open_for_worker(log, "x"))
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_no_rotation_at_or_under_the_size(log: Path) -> None:
    log.write_bytes(b"x" * 100)
    assert rotate_if_needed(log, 100, 3) is False
    assert rotate_if_needed(log, 1000, 3) is False
    assert log.read_bytes() == b"x" * 100
    assert not backup(log, 1).exists()


def test_missing_file_is_not_rotated(log: Path) -> None:
    assert rotate_if_needed(log, 0, 3) is False
    assert not log.exists()


def test_rotation_copies_then_truncates(log: Path) -> None:
    log.write_bytes(b"old line\n")
    assert rotate_if_needed(log, 4, 3) is True
    assert log.read_bytes() == b""
    assert backup(log, 1).read_bytes() == b"old line\n"
    assert stat.S_IMODE(backup(log, 1).stat().st_mode) == 0o600


def test_backups_shift_and_the_oldest_is_dropped(log: Path) -> None:
    backup(log, 1).write_text("one\n")
    backup(log, 2).write_text("two\n")
    log.write_text("current\n")
    assert rotate_if_needed(log, 1, 2) is True
    assert backup(log, 1).read_text() == "current\n"
    assert backup(log, 2).read_text() == "one\n"
    assert not backup(log, 3).exists()  # "two" is gone


def test_backups_shift_into_a_free_slot(log: Path) -> None:
    backup(log, 1).write_text("one\n")
    backup(log, 2).write_text("two\n")
    log.write_text("current\n")
    assert rotate_if_needed(log, 1, 3) is True
    assert [backup(log, i).read_text() for i in (1, 2, 3)] == ["current\n", "one\n", "two\n"]


def test_repeated_rotations_keep_the_newest_copies(log: Path) -> None:
    for i in range(5):
        log.write_text(f"gen {i}\n")
        assert rotate_if_needed(log, 1, 2)
    assert backup(log, 1).read_text() == "gen 4\n"
    assert backup(log, 2).read_text() == "gen 3\n"
    assert not backup(log, 3).exists()


def test_zero_backups_only_truncates(log: Path) -> None:
    log.write_text("current\n")
    assert rotate_if_needed(log, 1, 0) is True
    assert log.read_bytes() == b""
    assert list(log.parent.iterdir()) == [log]


def test_append_fd_writes_at_the_new_end_after_rotation(log: Path) -> None:
    fd = open_for_worker(log, "starting")
    try:
        os.write(fd, b"before rotation\n")
        assert rotate_if_needed(log, 10, 1)
        os.write(fd, b"after rotation\n")
    finally:
        os.close(fd)
    assert log.read_bytes() == b"after rotation\n"  # no hole of NULs where the old data was
    old = backup(log, 1).read_text()
    assert "mlxceld: starting" in old
    assert old.endswith("before rotation\n")


# -- tail and read_from ----------------------------------------------------------------------------


def test_tail_fewer_lines_than_the_file(log: Path) -> None:
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    text, end = tail(log, 3)
    assert text == "line 7\nline 8\nline 9\n"
    assert end == log.stat().st_size


def test_tail_more_lines_than_the_file(log: Path) -> None:
    log.write_text("a\nb\n")
    assert tail(log, 50) == ("a\nb\n", 4)


def test_tail_keeps_an_unterminated_last_line(log: Path) -> None:
    log.write_text("a\nb\npartial")
    assert tail(log, 2) == ("b\npartial", 11)


def test_tail_zero_lines_still_gives_the_end(log: Path) -> None:
    log.write_text("a\nb\n")
    assert tail(log, 0) == ("", 4)


def test_tail_of_an_empty_or_missing_file(log: Path) -> None:
    assert tail(log, 5) == ("", 0)
    log.write_bytes(b"")
    assert tail(log, 5) == ("", 0)


def test_tail_across_read_chunks(log: Path) -> None:
    lines = [f"{i:07d}\n" for i in range(3 * READ_CHUNK // 8)]
    log.write_text("".join(lines))
    assert tail(log, 2)[0] == "".join(lines[-2:])
    many = READ_CHUNK // 8 + 100  # more lines than one chunk holds
    assert tail(log, many)[0] == "".join(lines[-many:])


def test_tail_replaces_undecodable_bytes(log: Path) -> None:
    log.write_bytes(b"ok\n\xff\xfe bad\n")
    assert tail(log, 1)[0] == "\ufffd\ufffd bad\n"


def test_read_from_follows_appends(log: Path) -> None:
    log.write_bytes(b"abc")
    assert read_from(log, 0) == (b"abc", 3)
    assert read_from(log, 3) == (b"", 3)
    with log.open("ab") as f:
        f.write(b"de")
    assert read_from(log, 3) == (b"de", 5)


def test_read_from_restarts_at_zero_after_truncation(log: Path) -> None:
    log.write_bytes(b"a long first generation\n")
    _, offset = read_from(log, 0)
    log.write_bytes(b"new\n")  # truncated and rewritten, as after a rotation
    assert read_from(log, offset) == (b"new\n", 4)


def test_read_from_missing_file(log: Path) -> None:
    assert read_from(log, 10) == (b"", 0)
