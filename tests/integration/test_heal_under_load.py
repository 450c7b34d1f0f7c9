"""A heal under load loses nothing, between real daemons on 127.0.0.x: a coordinator (.1)
serving a 2-stage plan over two of three peers (.2-.4: one a spare), with a short detector
and ``heal_after_s = 2``, under ``CLIENTS`` streaming `openai` clients with retries off
(``helpers/load.py``: every refusal and every broken stream is counted).

- A stage host SIGSTOPped (its daemon and its stage worker: a host asleep) past the grace:
  the coordinator heals onto the spare and the router moves to the new plan live; the
  sequences that were running on the silent host, and those that arrived meanwhile, are
  held and replayed there (``pipeline/replay.py``). No request fails or is refused, and
  at least one was in flight on the silent host when it stopped (the router's log says
  it replayed a sequence that had sent tokens); one more client's long greedy stream,
  begun before the stop, reads mlx-lm's greedy text whole (nothing repeated or lost).
- A stage worker SIGKILLed: its daemon restarts it (the host is alive: no heal); the
  sequences it ran are held and replayed on the same plan once it attached again; the
  long greedy stream reads mlx-lm's text whole here too.

The counts are printed (``pytest -s``)."""

from __future__ import annotations

import os
import re
import secrets
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.cluster import POLL_WAIT_S, activate, agent, settled, start
from helpers.daemons import READY_S, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.load import StreamingLoad
from helpers.metrics import parse_samples, sample
from helpers.models import expected
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PING_S, SUSPECT_S, DEAD_S, HEAL_S = 0.25, 1.0, 2.0, 2.0
COORDINATOR = f"""
[daemon]
peer_ping_interval_s = {PING_S}
peer_suspect_after_s = {SUSPECT_S}
peer_dead_after_s = {DEAD_S}
heal_after_s = {HEAL_S}
"""
CLIENTS = 4
MAX_TOKENS = 64  # long streams: several are running on the host when it stops
WARM_S = 2.0  # load before the fault, and after the plan serves again
WAIT_S = 90.0  # generous waits on a loaded machine
TRACKED = "Hello"  # greedy on the llama split fixture: no end-of-sequence for 800+ tokens
TRACKED_TOKENS = 200
REPLAYED = re.compile(r"replayed on (the new plan's engine|its stages back) after (\d+) token")


def cluster(daemons: Daemons, model: Path) -> tuple[list[DaemonProc], DaemonProc, int]:
    """Three peers and a coordinator with a short detector and grace, a 2-stage plan over
    two of the peers served."""
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, ip, secret, "--pp-peer", "--model", str(model), name=f"p{ip[-1]}")
             for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
    port = free_port("127.0.0.1")
    coord = daemons.make(COORDINATOR, name="c")
    coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                "--agent-addr", "127.0.0.1:0", "--port", str(port),
                "--cluster-peers", ",".join(agent(p) for p in peers))
    want = {agent(p): "reachable" for p in peers}
    wait_for(lambda: settled(coord, want), POLL_WAIT_S, f"peers {want}", every=0.2)
    activate(coord, model, 2)
    daemons.pids.add(coord.worker("router")["pid"])
    for p in peers:
        if any(w["name"] == "stage" for w in p.status()["workers"]):
            daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    return peers, coord, port


def staged(coord: DaemonProc, peers: list[DaemonProc]) -> list[DaemonProc]:
    """The peers of the served plan, in stage order."""
    by_agent = {agent(p): p for p in peers}
    return [by_agent[r["address"]] for r in coord.status()["bringup"]["peers"]]


class Tracked(threading.Thread):
    """One more client: a long greedy stream of ``TRACKED``, its text kept; ``begun`` once
    its first tokens came, so the fault hits it in flight."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/v1"
        self.begun = threading.Event()
        self.text = ""
        self.finish: str | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with client(self.url) as c:
                for chunk in c.completions.create(model="llama", prompt=TRACKED, stream=True,
                                                  max_tokens=TRACKED_TOKENS, temperature=0):
                    self.text += chunk.choices[0].text
                    self.finish = chunk.choices[0].finish_reason or self.finish
                    if len(self.text) > 8:
                        self.begun.set()
        except Exception as exc:  # asserted by the test
            self.error = exc
        finally:
            self.begun.set()


def replays(coord: DaemonProc) -> list[tuple[str, int]]:
    """What the router's log says it replayed: (on what, tokens sent before)."""
    log = (coord.state_dir / "logs" / "router.log").read_text(errors="replace")
    return [(m.group(1), int(m.group(2))) for m in REPLAYED.finditer(log)]


def test_a_heal_under_load_loses_nothing(daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    peers, coord, port = cluster(daemons, model)
    first = coord.status()["bringup"]
    victim = staged(coord, peers)[1]
    pids = [victim.pid, victim.worker("stage")["pid"]]
    want = expected(model, TRACKED, TRACKED_TOKENS)
    tracked = Tracked(port)
    with StreamingLoad(f"http://127.0.0.1:{port}/v1", clients=CLIENTS,
                       max_tokens=MAX_TOKENS) as load:
        time.sleep(WARM_S)
        tracked.start()
        assert tracked.begun.wait(WAIT_S) and tracked.is_alive(), tracked.error
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            healed = wait_for(lambda: (b := coord.status()["bringup"])["epoch"] > first["epoch"]
                              and b["state"] == "active" and b, WAIT_S, "the heal", every=0.1)
            healed_s = time.monotonic() - stopped
            time.sleep(WARM_S)
            tracked.join(WAIT_S)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
    counts = load.counts()
    done = replays(coord)
    print(f"\nheal (SIGSTOP of a stage host, a spare) under load ({CLIENTS} streaming clients, "
          f"{MAX_TOKENS} tokens each): {counts}; healed {healed_s:.1f} s after SIGSTOP; "
          f"replayed: {done}; refused: {load.refused[:3]}; failed: {load.failed[:3]}")
    daemons.pids.add(coord.worker("router")["pid"])
    for p in peers:
        daemons.note(p)
    assert (counts["refused"], counts["failed"]) == (0, 0), (load.refused[:3], load.failed[:3])
    assert counts["completed"] > 0
    assert victim.root not in {p.root for p in staged(coord, peers)}, healed
    # in flight on the silent host when it stopped: tokens sent, then replayed on the new plan
    assert any(on == "the new plan's engine" and sent > 0 for on, sent in done), done
    # the tracked stream, stopped in flight: one stream, an unbroken run's greedy text
    assert tracked.error is None and tracked.finish == "length", tracked.error
    assert tracked.text == want
    # and /metrics counts them: every replay the log names, none held now, none lost
    metrics = parse_samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    assert (sample(metrics, "mlxceld_sequences_replayed_total") or 0) >= len(done), metrics
    assert (sample(metrics, "mlxceld_sequences_held_now"),
            sample(metrics, "mlxceld_sequences_lost_total")) == (0, 0)


def test_a_stage_worker_killed_under_load_loses_nothing(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    peers, coord, port = cluster(daemons, model)
    victim = staged(coord, peers)[1]
    killed = victim.worker("stage")["pid"]
    want = expected(model, TRACKED, TRACKED_TOKENS)
    tracked = Tracked(port)
    with StreamingLoad(f"http://127.0.0.1:{port}/v1", clients=CLIENTS,
                       max_tokens=MAX_TOKENS) as load:
        time.sleep(WARM_S)
        tracked.start()
        assert tracked.begun.wait(WAIT_S) and tracked.is_alive(), tracked.error
        os.kill(killed, signal.SIGKILL)
        again = wait_for(lambda: (w := victim.worker("stage"))["pid"] not in (None, killed)
                         and w["state"] == "running" and w, WAIT_S, "the stage restarted",
                         every=0.1)
        daemons.pids.add(again["pid"])
        time.sleep(WARM_S)
        tracked.join(WAIT_S)
    counts = load.counts()
    done = replays(coord)
    print(f"\nSIGKILL of a stage worker under load ({CLIENTS} streaming clients, "
          f"{MAX_TOKENS} tokens each): {counts}; replayed: {done}; refused: "
          f"{load.refused[:3]}; failed: {load.failed[:3]}")
    for p in peers:
        daemons.note(p)
    assert (counts["refused"], counts["failed"]) == (0, 0), (load.refused[:3], load.failed[:3])
    assert counts["completed"] > 0
    assert any(sent > 0 for _, sent in done), done
    assert tracked.error is None and tracked.finish == "length", tracked.error
    assert tracked.text == want
