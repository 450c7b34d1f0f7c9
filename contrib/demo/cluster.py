"""A zero-config 2-stage cluster on this machine: `mlxceld --pp-auto 2` and two peers.

`make run` runs this. Under --dir it writes a cluster secret (0600) and, unless
--model names a checkpoint, a tiny random-weight fixture; then it starts two
peers (`mlxceld --pp-peer`, 127.0.0.2 and 127.0.0.3) and a coordinator
(`mlxceld --pp-auto 2 --cluster-peers ...`, 127.0.0.1), each a real daemon
with its own state dir, control socket and log file. The coordinator plans
the split from the peers' inventory and assigns the stages (two-phase: offer,
prepare, commit, activate); no cluster TOML is written by hand.

It says each step as it goes: the fixture generated, each daemon started and
answering, the coordinator waiting for its peers and planning, the plan, each
peer's steps (offered, loading, prepared, committed, active) and how far it has
loaded its stage (a bar per peer on a terminal, else a line per tenth, as
`mlxctl cluster activate` shows them: mlxctl/progress.py), the router starting.
It waits until the router answers a completion (at most READY_S), prints
"ready: URL", a curl and an `openai` snippet and `mlxctl status` of the
coordinator, then runs until Ctrl-C (or SIGTERM, or a daemon exiting). Then it
stops every process it started, by pid: SIGTERM to each daemon (which stops
its workers), SIGKILL after STOP_S to anything left, and checks that none is.

Where 127.0.0.2 and .3 cannot be bound (macOS without `sudo ifconfig lo0 alias`),
every node is 127.0.0.1 with its own port: a node's identity is its host:port.

    .venv/bin/python contrib/demo/cluster.py [--model DIR] [--port 8080] [--dir .demo/cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from pipeline import CONFIG, LOOPBACK_ONLY, Daemons, descendants, stage_hosts, stop, tail
from rich.console import Console

from mlxceld.control.clients.typed import ControlClient
from mlxceld.errors import ControlError
from mlxceld.models import preset, write_fixture
from mlxceld.privatefile import write_private
from mlxctl.progress import LoadView

READY_S = 180.0  # the peers load their stages, the coordinator pushes, the router attaches
SOCKET_S = 30.0  # a daemon's control socket answers
POLL_S = 0.5
FIXTURE = "tiny-qwen3"



def ask(sock: Path, what: str) -> dict[str, Any]:
    """One control API call (``status`` or ``version``) to the daemon on ``sock``."""

    async def go() -> dict[str, Any]:
        async with ControlClient(sock) as c:
            return await (c.status() if what == "status" else c.version())

    return asyncio.run(go())


def start(root: Path, node: str, host: str, *extra: str) -> subprocess.Popen[bytes]:
    """One daemon in its own session, so that Ctrl-C reaches only us and we stop it."""
    with (root / f"{node}.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "mlxceld", "--config", str(CONFIG),
             "--state-dir", str(root / node), "--socket", str(root / f"{node}.sock"),
             "--agent-addr", f"{host}:0", "--cluster-secret-file", str(root / "secret"),
             *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)


def check_alive(daemons: Daemons, root: Path) -> None:
    for node, proc in daemons.items():
        if proc.poll() is not None:
            raise SystemExit(f"{node} exited with {proc.returncode}; its log:\n"
                             f"{tail(root / f'{node}.log')}")


def agent_address(root: Path, node: str, daemons: Daemons, stopping: threading.Event) -> str:
    """The peer's agent address (host:port it bound), once its control socket answers."""
    deadline = time.monotonic() + SOCKET_S
    while time.monotonic() < deadline and not stopping.is_set():
        check_alive(daemons, root)
        with contextlib.suppress(ControlError):
            address = ask(root / f"{node}.sock", "status")["agent"]["address"]
            if address:
                return str(address)
        stopping.wait(0.2)
    if stopping.is_set():
        raise KeyboardInterrupt
    raise SystemExit(f"{node} did not answer on {root / f'{node}.sock'} within {SOCKET_S:g} s;"
                     f" its log:\n{tail(root / f'{node}.log')}")


def say(line: str) -> None:
    print(line, flush=True)


def wait_ready(url: str, model: str, root: Path, daemons: Daemons,
               stopping: threading.Event) -> bool:
    """Until the bring-up is active and one completion comes back, saying each step of
    it (``show_bringup``); False if asked to stop first; SystemExit naming the reason if
    the bring-up fails or time runs out."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 1}
    deadline = time.monotonic() + READY_S
    view = LoadView(say, Console() if sys.stdout.isatty() else None)
    said: set[str] = set()  # the coordinator's steps said
    try:
        while time.monotonic() < deadline:
            if stopping.is_set():
                return False
            check_alive(daemons, root)
            with contextlib.suppress(ControlError):
                bringup = ask(root / "coordinator.sock", "status").get("bringup") or {}
                show_bringup(view, bringup, url, said)
                if bringup.get("state") == "failed":
                    raise SystemExit(f"the bring-up failed: {bringup.get('summary')}\nsee "
                                     f"the logs in {root}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.post(f"{url}/completions", json=body, timeout=10).status_code == 200:
                    return True
            stopping.wait(POLL_S)
    finally:
        view.close()
    raise SystemExit(f"the router at {url} did not answer within {READY_S:g} s; see the logs "
                     f"in {root}")


def show_bringup(view: LoadView, bringup: dict[str, Any], url: str, said: set[str]) -> None:
    """The coordinator's bring-up as it goes: waiting for its peers and planning, the plan,
    each peer's steps and how far it has loaded its stage (a bar on a terminal, else a
    line per tenth: ``mlxctl cluster activate``'s view), then the router starting."""
    state = bringup.get("state")
    if state in ("planning", "pushing", "active") and "planning" not in said:
        said.add("planning")
        view.step(f"the coordinator waits for its {bringup.get('stages')} peers to answer, "
                  "reads their inventory and plans the split...")
    if state in ("pushing", "active") and "plan" not in said and bringup.get("peers"):
        said.add("plan")
        view.step(f"plan {bringup.get('epoch')}: {len(bringup['peers'])} stage(s); each peer "
                  "loads its layers (offered, loading, prepared), then commits and activates:")
    view.peers(bringup.get("peers") or [])
    if state == "active" and "active" not in said:
        said.add("active")
        view.step(f"bring-up: {bringup.get('summary')}; the router starts at {url} and "
                  "attaches to the stages...")


def usage(args: argparse.Namespace, root: Path, peers: dict[str, str], python: str) -> str:
    url, name = f"http://127.0.0.1:{args.port}/v1", args.model_name
    mlxctl = Path(python).with_name("mlxctl")
    ctl = str(mlxctl) if mlxctl.exists() else f"{python} -m mlxctl"
    status = subprocess.run([python, "-m", "mlxctl", "--socket", str(root / "coordinator.sock"),
                             "status"], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "NO_COLOR": "1"})
    lines = [
        f"ready: {url}", "",
        f"A 2-stage pipeline (mlxceld --pp-auto 2) serves {args.model} as {name!r}:",
        f"  {'coordinator':12} {'127.0.0.1 (the router)':24} log {root}/coordinator.log",
        *(f"  {node:12} {addr:24} log {root}/{node}.log" for node, addr in peers.items()),
        "", "Try it:", "",
        f"  curl -s {url}/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
        "\"Hello!\"}], \"max_tokens\": 32}'", "",
        f"  {python} -c 'import openai; c = openai.OpenAI(base_url=\"{url}\", "
        "api_key=\"none\"); \\",
        f"    print(c.chat.completions.create(model=\"{name}\", messages=[{{\"role\": "
        "\"user\", \"content\": \"Hello!\"}], max_tokens=32).choices[0].message.content)'", "",
        f"$ {ctl} --socket {root}/coordinator.sock status",
        (status.stdout or status.stderr).rstrip(), "",
        "The peers (their `mlxctl status`, in short):",
        *(f"  {node:12} {addr:24} {peer_line(root, node)}" for node, addr in peers.items()),
        "",
        f"  {ctl} --socket {root}/peer-1.sock status     # a peer: its stage and assignment",
        f"  {ctl} --socket {root}/coordinator.sock events  # the bring-up, step by step",
        f"  {ctl} --socket {root}/peer-2.sock logs stage -f", ""]
    if next(iter(peers.values())).startswith("127.0.0.1:"):
        lines += LOOPBACK_ONLY
    lines.append("Stop all three with Ctrl-C here.")
    return "\n".join(lines)


def peer_line(root: Path, node: str) -> str:
    """A peer's stage and its assignment, from its status."""
    try:
        body = ask(root / f"{node}.sock", "status")
    except ControlError as exc:
        return f"(no answer: {exc.message})"
    a, c = body.get("assignment") or {}, body.get("cluster") or {}
    if not a:
        return "no assignment"
    layers = f", layers [{c['layers'][0]}, {c['layers'][1]})" if c.get("layers") else ""
    return f"{a.get('stage')} {a.get('state')} (plan {a.get('epoch')}){layers}"


def prepare(args: argparse.Namespace, root: Path) -> None:
    """The router's port free, the secret (kept across runs), the model (a generated
    fixture unless given)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", args.port))
        except OSError as exc:
            raise SystemExit(f"--port {args.port}: 127.0.0.1:{args.port} cannot be used "
                             f"({exc.strerror}); pick another, e.g. make run PORT="
                             f"{args.port + 1}") from None
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = root / "secret"
    if not secret.exists():
        write_private(secret, (secrets.token_bytes(32).hex() + "\n").encode())
    if args.model is None:
        args.model = root / FIXTURE
        if not (args.model / "config.json").exists():
            say(f"No --model given: generating a tiny random-weight model in {args.model}...")
            write_fixture(args.model, preset("tiny", family="qwen3", layers=4))
            say(f"generated {args.model}")
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there; give an mlx-lm "
                         "model directory")
    args.model = args.model.resolve()
    args.model_name = args.model_name or args.model.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an mlx-lm model directory (default: a "
                        f"generated fixture in DIR/{FIXTURE})")
    parser.add_argument("--model-name", help="the model id clients see (default: its name)")
    parser.add_argument("--port", type=int, default=8080, help="the router's OpenAI port")
    parser.add_argument("--dir", type=Path, default=Path(".demo/cluster"))
    args = parser.parse_args()
    root = args.dir.resolve()
    prepare(args, root)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())  # only note it; the loops below act
    hosts = stage_hosts()
    daemons: Daemons = {}
    known: set[int] = set()
    left: list[int] = []
    try:
        for i, host in enumerate(hosts, 1):
            say(f"starting peer-{i}: mlxceld --pp-peer on {host} (log {root}/peer-{i}.log)")
            daemons[f"peer-{i}"] = start(root, f"peer-{i}", host, "--pp-peer",
                                         "--model", str(args.model))
        peers = {}
        for node in daemons:
            peers[node] = agent_address(root, node, daemons, stopping)
            say(f"{node} is up (pid {daemons[node].pid}): its agent listens on {peers[node]}")
        say(f"starting the coordinator: mlxceld --pp-auto 2 on 127.0.0.1, the router on port "
            f"{args.port} (log {root}/coordinator.log)")
        daemons["coordinator"] = start(
            root, "coordinator", "127.0.0.1", "--pp-auto", "2", "--cluster-peers",
            ",".join(peers.values()), "--model", str(args.model), "--model-name",
            args.model_name, "--port", str(args.port))
        print(f"Started 3 daemons (pids {', '.join(str(p.pid) for p in daemons.values())}); "
              f"the coordinator plans and assigns the stages...", flush=True)
        if wait_ready(f"http://127.0.0.1:{args.port}/v1", args.model_name, root, daemons,
                      stopping):
            print(usage(args, root, peers, sys.executable), flush=True)
        while not stopping.wait(POLL_S):
            known |= descendants(daemons)
            check_alive(daemons, root)
    except KeyboardInterrupt:
        pass
    finally:
        print("\nStopping the coordinator and both peers...", flush=True)
        known |= descendants(daemons)
        left = stop(daemons, known)
        if left:
            print(f"still running after the stop: pids {left}", file=sys.stderr)
        else:
            print(f"Stopped; none of the {len(known)} processes started is left "
                  f"(pids {json.dumps(sorted(known))}).", flush=True)
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
