"""`make run`'s demo (contrib/demo/cluster.py), run as a script: a `--pp-auto 2` cluster of
three real daemons on loopback serves a completion; SIGINT stops every process it started.
Off a terminal it says each step of the bring-up on a line, each stage's load per tenth
(each layer's read slowed by ``MLXCELD_TEST_STAGE_LAYER_S``, so that the load is seen)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers.daemons import alive
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import complete

DEMO = Path(__file__).resolve().parents[2] / "contrib" / "demo" / "cluster.py"
READY_S = 240.0  # the script's own READY_S (180 s) and its start-up
STOP_S = 90.0  # the script gives each daemon 30 s
LAYER_S = 1.0  # each stage: 2 layers, so three pauses: a 'preparing' heartbeat (2 s) sees it


def recorded_pids(root: Path) -> set[int]:
    """Every worker pid the demo's state databases know (read-only)."""
    pids: set[int] = set()
    for db in root.glob("*/state.db"):
        with contextlib.suppress(sqlite3.Error), contextlib.closing(
                sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            pids |= {r[0] for r in conn.execute("select pid from workers where pid is not null")}
    return pids


@pytest.mark.slow
def test_demo_serves_and_ctrl_c_stops_every_process(split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "qwen3"
    root = Path(tempfile.mkdtemp(prefix="mxdemo", dir="/tmp"))  # short socket paths
    port = free_port("127.0.0.1")
    demo = subprocess.Popen(
        [sys.executable, str(DEMO), "--model", str(model), "--port", str(port),
         "--dir", str(root)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "NO_COLOR": "1", "MLXCELD_TEST_STAGE_LAYER_S": str(LAYER_S)})
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started: set[int] = set()
    try:
        deadline = time.monotonic() + READY_S
        while not any(line.startswith("Stop all three with Ctrl-C") for line in output):
            assert time.monotonic() < deadline, "no 'ready' within READY_S:\n" + "".join(output)
            assert demo.poll() is None or not lines.empty(), "".join(output)
            with contextlib.suppress(queue.Empty):
                output.append(lines.get(timeout=1))
            if m := re.search(r"Started 3 daemons \(pids ([\d, ]+)\)", output[-1] if output
                              else ""):
                started |= {int(p) for p in m.group(1).split(", ")}
        text = "".join(output)
        assert f"\nready: http://127.0.0.1:{port}/v1\n" in text, text
        assert "curl -s" in text and "import openai" in text, text
        steps = text.split(f"\nready: http://127.0.0.1:{port}/v1\n")[0].splitlines()
        assert steps[0].startswith("starting peer-1: mlxceld --pp-peer on "), steps
        assert any(re.fullmatch(r"peer-2 is up \(pid \d+\): its agent listens on \S+", line)
                   for line in steps), steps
        assert any(line.startswith("starting the coordinator: mlxceld --pp-auto 2 on "
                                   "127.0.0.1") for line in steps), steps
        assert any(line.startswith("the coordinator waits for its 2 peers")
                   for line in steps), steps
        assert any(re.match(r"plan \d+: 2 stage\(s\)", line) for line in steps), steps
        loads = [line for line in steps
                 if re.fullmatch(r"\s+stage-[01]\s+\S+\s+layers \[\d, \d\)\s+loading \d+% of "
                                 r"[\d.]+ [KM]iB, \d+ s", line)]
        assert loads, steps  # each stage's load, a line per tenth
        for stage in ("stage-0", "stage-1"):
            said = [line.split()[5] for line in steps if line.split()[:1] == [stage]]
            assert said[0] == "offered" and "loading" in said and said[-1].startswith(
                "active"), (stage, steps)
        assert any(line.startswith("bring-up: ") and "the router starts at" in line
                   for line in steps), steps
        assert "bring-up: active" in text and "router" in text, text  # mlxctl status
        assert "stage-0 active (plan" in text and "stage-1 active (plan" in text, text
        assert complete(port, "qwen3", 6) == expected(model, PROMPT, 6)
        workers = recorded_pids(root)
        assert len(workers) >= 3, workers  # two stages and the router
        started |= workers

        demo.send_signal(signal.SIGINT)
        assert demo.wait(STOP_S) == 0, "".join(output)
        reader.join(10)
        while not lines.empty():
            output.append(lines.get())
        text = "".join(output)
        assert "none of the" in text and "is left" in text, text
        m = re.search(r"is left \(pids \[([\d, ]+)\]\)", text)
        assert m is not None, text
        reported = {int(p) for p in m.group(1).split(", ")}
        assert started <= reported, (started, reported)
        assert not [p for p in started | reported if alive(p)], text
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        reader.join(10)
        assert demo.stdout is not None
        demo.stdout.close()
        for pid in started | recorded_pids(root):
            if alive(pid):
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()
        shutil.rmtree(root, ignore_errors=True)
