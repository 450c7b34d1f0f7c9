"""Logging under systemd: where stderr is the journal (``JOURNAL_STREAM`` names its device and
inode) each line starts with its syslog priority and has no time of its own; elsewhere (no
variable, or stderr redirected to another file) the lines are as before."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from mlxceld.logformat import formatter, priority

from helpers.daemons import Daemons

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def journal_of(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}"


def test_the_priorities_of_sd_daemon() -> None:
    assert [priority(n) for n in (logging.CRITICAL, logging.ERROR, logging.WARNING,
                                  logging.INFO, logging.DEBUG)] == [2, 3, 4, 6, 7]


def test_every_line_of_a_record_carries_the_priority() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("mlxceld.x").makeRecord(
            "mlxceld.x", logging.ERROR, __file__, 1, "failed: %s", ("why",), sys.exc_info())
    lines = formatter("text", journal=True).format(record).split("\n")
    assert lines[0] == "<3>ERROR mlxceld.x: failed: why"
    assert len(lines) > 2 and all(line.startswith("<3>") for line in lines)
    assert lines[-1] == "<3>ValueError: boom"
    assert formatter("json", journal=True).format(record).startswith("{")  # json as is


def test_a_daemon_whose_stderr_is_the_journal(daemons: Daemons) -> None:
    d = daemons.make("")
    d.stderr_path.touch()
    d.start(env={"JOURNAL_STREAM": journal_of(d.stderr_path)})
    assert d.terminate() == 0
    lines = [line for line in d.stderr().splitlines() if line]
    assert any(re.fullmatch(r"<6>INFO mlxceld\.daemon: mlxceld \S+ ready: .*", line)
               for line in lines), lines
    assert all(re.match(r"<[2-7]>[A-Z]+ ", line) for line in lines), lines
    assert not any(STAMP.match(line[3:]) for line in lines)  # journald adds the time


def test_a_daemon_with_stderr_elsewhere_keeps_its_lines(daemons: Daemons, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    other.touch()
    d = daemons.make("")
    d.start(env={"JOURNAL_STREAM": journal_of(other)})  # the unit's, but 2> redirected
    assert d.terminate() == 0
    lines = [line for line in d.stderr().splitlines() if line]
    assert lines and all(STAMP.match(line) for line in lines), lines
    assert any(" INFO mlxceld.daemon: mlxceld " in line for line in lines)


def test_a_warning_is_priority_4(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o644)  # the check warns of it
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "st"\ncluster_secret_file = "{secret}"\n')
    err = tmp_path / "stderr"
    with err.open("wb") as stream:
        done = subprocess.run([sys.executable, "-m", "mlxceld", "--check-config", "-c",
                               str(cfg)], stdout=subprocess.PIPE, stderr=stream, timeout=120,
                              env={**os.environ, "JOURNAL_STREAM": journal_of(err)},
                              stdin=subprocess.DEVNULL)
    assert done.returncode == 0
    [line] = err.read_text().splitlines()
    assert line.startswith("<4>WARNING mlxceld.config.secrets: cluster secret file ")
