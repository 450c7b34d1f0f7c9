"""mlxctl's fast path against a real daemon: ``status``, ``workers`` and ``logs`` import
nothing heavy, and say exactly what typer's commands say, with the same exit codes.

Speed itself is bench/status_latency.py's to measure; here only what is imported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons

ONE_ECHO = FAST_POLICY + """
[workers.alpha]
role = "echo"
options = { interval_s = 3600 }
"""
# What a read-only command has no use for: the model runtime, the daemon's rooms, the
# CLI framework and its dependencies, a general HTTP client, the event loop.
HEAVY = ("mlx", "mlx_lm", "numpy", "mlxceld.cluster", "mlxceld.models", "mlxceld.wire",
         "mlxceld.state", "mlxceld.supervisor", "mlxceld.control.server", "typer", "click",
         "rich", "pydantic", "shellingham", "httpx", "httpcore", "anyio", "asyncio",
         "psutil", "starlette", "uvicorn", "sqlite_utils", "cryptography", "zeroconf")
TYPER = [sys.executable, "-c", "from mlxctl.app import app; app(prog_name='mlxctl')"]
FAST = [sys.executable, "-m", "mlxctl"]
ENV = {"NO_COLOR": "1", "MLXCELD_SOCKET": ""}


def imported(argv: Sequence[str]) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "mlxctl", *argv],
                         capture_output=True, text=True, timeout=60)
    modules = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines()
               if line.startswith("import time:") and "|" in line}
    assert "mlxctl.fastpath" in modules and "json" in modules  # the listing is complete
    return out, modules


def heavy(modules: set[str]) -> set[str]:
    return {m for m in modules for h in HEAVY if m == h or m.startswith(h + ".")}


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    """One daemon for the module: every command run on it only reads."""
    owner = Daemons()
    try:
        d = owner.make(ONE_ECHO).start()
        d.wait_worker("alpha", state="running")
        yield d
    finally:
        owner.end()


@pytest.mark.parametrize("argv", [["status"], ["workers", "--json"], ["logs", "alpha"],
                                  ["logs", "alpha", "-n", "3", "--json"]], ids=" ".join)
def test_read_only_commands_import_nothing_heavy(daemon: DaemonProc, argv: list[str]) -> None:
    out, modules = imported(["--socket", str(daemon.socket), *argv])
    assert out.returncode == 0, out.stderr[-2000:]
    assert heavy(modules) == set()


def test_failures_import_nothing_heavy_either(daemons: Daemons) -> None:
    d = daemons.make()
    out, modules = imported(["--socket", str(d.socket), "status"])
    assert out.returncode == 3 and "mlxceld is not running" in out.stderr
    assert heavy(modules) == set()


def test_other_commands_still_go_through_typer(daemon: DaemonProc) -> None:
    out, modules = imported(["--socket", str(daemon.socket), "version"])
    assert out.returncode == 0 and "mlxceld" in out.stdout
    assert "typer" in modules


def both(argv: Sequence[str]) -> tuple[subprocess.CompletedProcess[str], ...]:
    return tuple(subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=60,
                                env={**os.environ, **ENV})
                 for prefix in (FAST, TYPER))


def unclocked(text: str) -> str:
    """``text`` without what changes from one second to the next (uptimes, memory), nor the
    padding of a table's columns, which widen with them (``9s`` then ``10s``)."""
    text = re.sub(r"\b\d+(\.\d+)? (B|KiB|MiB|GiB)\b", "SIZE", text)
    text = re.sub(r"\b(\d+[dhm])?\d+[smh]\b", "TIME", text)
    return re.sub(r"  +", "  ", text)


@pytest.mark.parametrize("argv", [["logs", "alpha"], ["logs", "alpha", "--json", "-n", "1"],
                                  ["logs", "ghost"], ["logs", "ghost", "--json"],
                                  ["workers"], ["status"], ["status", "--json"]],
                         ids=" ".join)
def test_the_fast_path_says_what_typer_says(daemon: DaemonProc, argv: list[str]) -> None:
    fast, slow = both(["--socket", str(daemon.socket), *argv])
    assert fast.returncode == slow.returncode
    assert unclocked(fast.stderr) == unclocked(slow.stderr)
    if "--json" in argv and argv[0] == "status":
        a, b = json.loads(fast.stdout), json.loads(slow.stdout)
        assert (a["schema"], sorted(a)) == (b["schema"], sorted(b))
        assert [w["name"] for w in a["workers"]] == [w["name"] for w in b["workers"]]
    else:
        assert unclocked(fast.stdout) == unclocked(slow.stdout)
    if argv[1:2] == ["ghost"]:
        assert fast.returncode == 1 and "no worker named 'ghost'" in fast.stdout + fast.stderr
    else:
        assert fast.returncode == 0 and fast.stdout


@pytest.mark.parametrize("argv", [["status"], ["workers", "--json"], ["logs", "x"]],
                         ids=" ".join)
def test_no_daemon_the_same_way(daemons: Daemons, argv: list[str]) -> None:
    d = daemons.make()
    fast, slow = both(["--socket", str(d.socket), *argv])
    assert (fast.returncode, fast.stdout, fast.stderr) == (3, slow.stdout, slow.stderr)
    assert slow.returncode == 3


def test_a_reader_that_goes_away(daemon: DaemonProc) -> None:
    """``mlxctl logs alpha | head -0``: exit 1 and nothing on stderr, as with typer."""
    codes = []
    for prefix in (FAST, TYPER):
        proc = subprocess.Popen([*prefix, "--socket", str(daemon.socket), "logs", "alpha"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
        codes.append((proc.returncode, err))
    assert codes[0] == codes[1] == (1, b"")
