"""A 2-stage pipeline on this machine: a coordinator and two stages, three daemons.

`make run-pipeline` runs this. It writes a cluster secret (0600) and a cluster
TOML (mlxcel-cluster.toml(5)) under --dir, starts one mlxceld per node, each
with its own state dir, control socket and log file, waits until the
coordinator's router answers a completion, prints what to try, and stops all
three (by pid) on Ctrl-C or when one of them exits.

The coordinator is 127.0.0.1 and the stages 127.0.0.2 and 127.0.0.3, as on
three hosts. Where those addresses cannot be bound (macOS has only 127.0.0.1
until `sudo ifconfig lo0 alias 127.0.0.2 up`), every node is 127.0.0.1 with
its own port: a node's identity is its host:port, so that works as well.

    .venv/bin/python contrib/demo/pipeline.py --model DIR [--port 8080] [--dir .demo/pipeline]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from mlxceld.models import layer_count, read_model_config
from mlxceld.privatefile import write_private

READY_S = 120.0
STOP_S = 30.0
CONFIG = Path(__file__).with_name("mlxceld.toml")

Daemons = dict[str, subprocess.Popen[bytes]]
# Printed where the system has no 127.0.0.2 and .3 (macOS until they are aliased).
LOOPBACK_ONLY = ["127.0.0.2 and 127.0.0.3 are not available here, so every node is "
                 "127.0.0.1 with its own port.",
                 "For one address per node on macOS: sudo ifconfig lo0 alias 127.0.0.2 up; "
                 "sudo ifconfig lo0 alias 127.0.0.3 up", ""]


def stage_hosts() -> list[str]:
    """127.0.0.2 and .3 where they can be bound (Linux), else 127.0.0.1 twice."""
    try:
        for host in ("127.0.0.2", "127.0.0.3"):
            with socket.socket() as s:
                s.bind((host, 0))
    except OSError:
        return ["127.0.0.1", "127.0.0.1"]
    return ["127.0.0.2", "127.0.0.3"]


def write_cluster(root: Path, model: Path, hosts: list[str], base_port: int) -> Path:
    """The secret (kept across runs) and the cluster TOML; the layers split in half."""
    secret = root / "secret"
    if not secret.exists():
        write_private(secret, (secrets.token_bytes(32).hex() + "\n").encode())
    layers = layer_count(read_model_config(model))
    if layers < 2:
        raise SystemExit(f"{model} has {layers} layer; two stages need at least 2")
    half = layers // 2
    text = ("# Written by contrib/demo/pipeline.py; see mlxcel-cluster.toml(5).\n"
            "[cluster]\nname = \"demo\"\npipeline_parallel_size = 2\n"
            f"model = {json.dumps(str(model.resolve()))}\nsecret_file = \"secret\"\n\n"
            "[[nodes]]\nid = \"coordinator\"\n"
            f"address = \"127.0.0.1:{base_port}\"\nrole = \"coordinator\"\n")
    for rank, (start, end) in enumerate([(0, half), (half, layers)]):
        text += (f"\n[[nodes]]\nid = \"stage-{rank}\"\n"
                 f"address = \"{hosts[rank]}:{base_port + 1 + rank}\"\n"
                 f"role = \"pipeline_stage\"\nrank = {rank}\nlayers = [{start}, {end}]\n")
    toml = root / "cluster.toml"
    toml.write_text(text)
    return toml


def start(root: Path, toml: Path, node: str, host: str, *extra: str) -> subprocess.Popen[bytes]:
    """One daemon in its own session, so that Ctrl-C reaches only us and we stop it."""
    with (root / f"{node}.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "mlxceld", "--config", str(CONFIG),
             "--state-dir", str(root / node), "--socket", str(root / f"{node}.sock"),
             "--agent-addr", f"{host}:0", "--distributed-config", str(toml),
             "--node-id", node, *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)


def wait_answering(url: str, model: str, daemons: dict[str, subprocess.Popen[bytes]],
                   root: Path, stopping: threading.Event) -> bool:
    """Until one completion comes back (the stages load, then the router attaches them);
    False if we are asked to stop first."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 1}
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if stopping.is_set():
            return False
        for node, proc in daemons.items():
            if proc.poll() is not None:
                raise SystemExit(f"{node} exited with {proc.returncode}; its log:\n"
                                 f"{tail(root / f'{node}.log')}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(f"{url}/completions", json=body, timeout=10).status_code == 200:
                return True
        stopping.wait(0.5)
    raise SystemExit(f"the router at {url} did not answer within {READY_S:g} s; see the logs "
                     f"in {root}")


def tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


def descendants(daemons: Daemons) -> set[int]:
    """Every pid we started: the daemons and, below them, their workers."""
    pids = {p.pid for p in daemons.values()}
    for proc in daemons.values():
        with contextlib.suppress(psutil.Error):
            pids |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    return pids


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop(daemons: Daemons, known: set[int]) -> list[int]:
    """SIGTERM each daemon (it stops its workers); SIGKILL what is left after STOP_S.
    Returns the pids still alive at the end (none, normally)."""
    known |= descendants(daemons)
    for proc in daemons.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for node, proc in daemons.items():
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            print(f"{node} did not stop within {STOP_S:g} s; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()
    for pid in known:
        if alive(pid):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    time.sleep(0.2)
    return sorted(pid for pid in known if alive(pid))


def usage(args: argparse.Namespace, root: Path, hosts: list[str], python: str) -> str:
    url, name = f"http://127.0.0.1:{args.port}/v1", args.model_name
    mlxctl = str(Path(python).with_name("mlxctl"))
    lines = [
        "", f"A 2-stage pipeline serves {args.model} as {name!r} on {url}:",
        f"  {'coordinator':12} {'127.0.0.1 (the router)':24} log {root}/coordinator.log",
        f"  {'stage-0':12} {f'{hosts[0]}:{args.base_port + 1}':24} log {root}/stage-0.log",
        f"  {'stage-1':12} {f'{hosts[1]}:{args.base_port + 2}':24} log {root}/stage-1.log",
        "", "In another terminal:", "",
        f"  curl -s {url}/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 32}}'", "",
        f"  {python} -c 'import openai; c = openai.OpenAI(base_url=\"{url}\", "
        "api_key=\"none\"); \\",
        f"    print(c.chat.completions.create(model=\"{name}\", messages=[{{\"role\": "
        "\"user\", \"content\": \"Hello!\"}], max_tokens=32).choices[0].message.content)'", "",
        f"  {mlxctl} --socket {root}/coordinator.sock status   # or stage-0.sock, "
        "stage-1.sock",
        f"  {mlxctl} --socket {root}/stage-1.sock logs stage -f", ""]
    if hosts[0] == "127.0.0.1":
        lines += LOOPBACK_ONLY
    lines.append("Stop all three with Ctrl-C here.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an mlx-lm model directory")
    parser.add_argument("--model-name", help="the model id clients see (default: its name)")
    parser.add_argument("--port", type=int, default=8080, help="the router's OpenAI port")
    parser.add_argument("--base-port", type=int, default=19100,
                        help="the coordinator's identity port; the stages listen on the "
                        "next two")
    parser.add_argument("--dir", type=Path, default=Path(".demo/pipeline"))
    args = parser.parse_args()
    args.model_name = args.model_name or args.model.resolve().name
    root = args.dir.resolve()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    hosts = stage_hosts()
    toml = write_cluster(root, args.model, hosts, args.base_port)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())  # only note it; the loop below acts
    daemons = {
        "stage-0": start(root, toml, "stage-0", hosts[0]),
        "stage-1": start(root, toml, "stage-1", hosts[1]),
        "coordinator": start(root, toml, "coordinator", "127.0.0.1", "--port",
                             str(args.port), "--model-name", args.model_name)}
    try:
        print(f"Starting 3 daemons (pids {', '.join(str(p.pid) for p in daemons.values())}); "
              f"cluster config {toml}", flush=True)
        if wait_answering(f"http://127.0.0.1:{args.port}/v1", args.model_name, daemons, root,
                          stopping):
            print(usage(args, root, hosts, sys.executable), flush=True)
        while not stopping.wait(0.5):
            for node, proc in daemons.items():
                if proc.poll() is not None:
                    raise SystemExit(f"{node} exited with {proc.returncode}; its log:\n"
                                     f"{tail(root / f'{node}.log')}")
    finally:
        print("\nStopping the coordinator and both stages...", flush=True)
        left = stop(daemons, descendants(daemons))
        print(f"still running after the stop: pids {left}" if left else "Stopped.")


if __name__ == "__main__":
    main()
