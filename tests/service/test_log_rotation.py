"""The daemon's own log file (``[daemon] log_file``, launchd's and Homebrew's) is rotated by
size, by copy-then-truncate so that a service manager's descriptor on the same file goes on
writing to it: ``[daemon] log_max_bytes`` (10 MiB) and ``log_backups`` (3)."""

from __future__ import annotations

import logging
import os
import signal
import stat
from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.errors import ConfigError
from mlxceld.supervisor.logfiles import RotatingLog

from helpers.daemons import Daemons
from helpers.waiting import wait_for


def record(text: str) -> logging.LogRecord:
    return logging.LogRecord("mlxceld.t", logging.INFO, __file__, 1, text, None, None)


def test_the_handler_rotates_and_keeps_its_backups(tmp_path: Path) -> None:
    path = tmp_path / "mlxceld.log"
    other = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # launchd's
    handler = RotatingLog(path, 300, 2)
    try:
        for i in range(40):
            handler.emit(record(f"line {i:02d} " + "x" * 40))
        os.write(other, b"from the service manager's descriptor\n")
        handler.emit(record("the last line"))
    finally:
        handler.close()
        os.close(other)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mlxceld.log", "mlxceld.log.1", "mlxceld.log.2"]
    assert path.stat().st_size <= 300 + 100
    text = path.read_text()
    assert "the last line" in text
    assert "from the service manager's descriptor" in text  # written at the new end
    assert "\0" not in text  # no hole left where the file was before the truncate
    assert "line 39" in (tmp_path / "mlxceld.log.1").read_text() + text


def test_zero_never_rotates(tmp_path: Path) -> None:
    path = tmp_path / "mlxceld.log"
    handler = RotatingLog(path, 0, 3)
    for i in range(50):
        handler.emit(record(f"line {i}"))
    handler.close()
    assert [p.name for p in tmp_path.iterdir()] == ["mlxceld.log"]


def test_the_settings_and_their_defaults(tmp_path: Path) -> None:
    plain = build_config({}, None, Overrides(state_dir=tmp_path))
    assert (plain.log_file_max_bytes, plain.log_file_backups) == (10 * 1024 * 1024, 3)
    cfg = build_config({"daemon": {"log_max_bytes": 0, "log_backups": 5}}, None,
                       Overrides(state_dir=tmp_path))
    assert (cfg.log_file_max_bytes, cfg.log_file_backups) == (0, 5)
    with pytest.raises(ConfigError, match=r"'daemon\.log_max_bytes' must be a non-negative"):
        build_config({"daemon": {"log_max_bytes": "10M"}}, None, Overrides(state_dir=tmp_path))


def test_a_daemon_rotates_its_log_file(daemons: Daemons) -> None:
    d = daemons.make("")
    log = d.root / "mlxceld.log"
    d.config.write_text(f'[daemon]\nlog_file = "{log}"\nlog_max_bytes = 1000\n'
                        'log_backups = 2\n')
    d.start()
    for _ in range(20):  # each reload logs its lines (`mlxctl reload`'s call)
        d.api(lambda c: c.reload())
    os.kill(d.pid, signal.SIGHUP)  # and reopens the file: still rotated after
    wait_for(lambda: sum(e["kind"] == "daemon.reloaded" for e in d.events()) >= 21, 60,
             "the SIGHUP's reload")
    for _ in range(10):
        d.api(lambda c: c.reload())
    assert d.terminate() == 0
    rotated = sorted(p.name for p in d.root.iterdir() if p.name.startswith("mlxceld.log"))
    assert rotated == ["mlxceld.log", "mlxceld.log.1", "mlxceld.log.2"]
    assert log.stat().st_size <= 1000 + 500
    assert "mlxceld stopped" in log.read_text()  # written after the rotations


def test_the_daemons_log_file_is_created_0600(daemons: Daemons) -> None:
    # Opened before the daemon sets its private umask: under the usual 022 it was 0644,
    # readable by every local user.
    d = daemons.make("")
    log = d.root / "logs" / "mlxceld.log"
    log.parent.mkdir()
    was = os.umask(0o022)
    try:
        d.start("--log-file", str(log))
    finally:
        os.umask(was)
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    log.unlink()  # moved away by another tool: the SIGHUP's reopen creates it 0600 too
    os.kill(d.pid, signal.SIGHUP)
    wait_for(log.exists, 30, "the log file created again after the SIGHUP")
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert d.terminate() == 0
