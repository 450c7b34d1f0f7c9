"""A tensor-parallel group across two "hosts", from flags (issue 32): rank 0's daemon on
127.0.0.2 (``--tp-size 2 --tp-peers 127.0.0.3:PORT``: its router is rank 0) and a rank
host on 127.0.0.3 (``--node-role tensor_parallel_rank``: its ``tp-1`` worker is rank 1),
the same tiny llama and cluster secret. The ring's ports and ranks travel over the
authenticated agent connection (``daemon/tensor_peers.py``, ``daemon/tensor_rank.py``).

Its greedy completions are mlx-lm's on the whole model; ``mlxctl status`` shows the
group on rank 0 and the rank on the rank host; a rank host killed (SIGKILL of its
daemon and its worker) ends a stream in flight with the group's error naming the rank
and its host (bounded, not a hang), ``/ready`` is 503 naming them while it is down, and
once the rank host's daemon starts again (same state dir, same flags, as a service
manager would) the group forms again and serves the same greedy text. A rank host's
daemon restarted at once (SIGTERM, then started again) keeps its ring end at a new port:
the group serves again within seconds, over the ring said moved (``tensor.ring_moved``),
and no request is held meanwhile. One module: its tests run in order; every process is
ended by pid."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.models import PROMPT, eos_ids, expected
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

RANK0, RANK1 = "127.0.0.2", "127.0.0.3"
# The group serves again within this once the rank host is back: its daemon's start, the
# next formation try (backoff at most 8 s), two processes' imports, the ring, the loads.
BACK_S = 90.0
# A stream in flight ends within this of the kill: rank 0's op link to rank 1 closes at
# once (engine/tensor.py's watchdog looks every 0.1 s), then BROKEN_GRACE_S (1 s).
ENDED_S = 10.0
# A stopped rank host's stream ends within this: rank 0 hears nothing on rank 1's op link
# for heartbeats.SILENCE_S (3 s), then BROKEN_GRACE_S (1 s); a loaded machine's slack.
SILENT_S = 12.0
# A rank host's daemon restarted: the group serves again well within the ring's 60 s
# deadline (a liveness bound; about 5 s here).
MOVED_S = 40.0
HUNG_S = 20.0  # a request unanswered this long during that restart is held: a failure
STOPPED_S = 10.0  # a daemon with no worker stops within this of SIGTERM (well under 1 s)
SECRET = b"k" * 32


@dataclass
class Group:
    daemons: Daemons
    rank0: DaemonProc
    rank1: DaemonProc
    rank1_flags: tuple[str, ...]
    url: str
    model: Path
    banned: dict[str, int]
    waiting: dict[str, Any]  # /ready's body while rank 1's host was not up yet

    def complete(self) -> str:
        with client(self.url) as c:
            out = c.completions.create(model="llama", prompt=PROMPT, max_tokens=8,
                                       temperature=0)
        return out.choices[0].text

    def serves(self) -> str:
        """The greedy completion once ``/ready`` says the group serves (within
        ``BACK_S``); the request itself is sent once, as a client would. ``/ready`` is
        polled as a load balancer does, and answered all along: 503 from the stand-in
        while the group forms and its router starts (both hold the port), never a
        refused connection."""
        if self.rank1.proc is not None and self.rank1.proc.poll() is not None:
            # a test before this one failed between its kill and the restart: the rank
            # host starts again as a service manager would, so that failure is not repeated
            # by the tests after it
            self.rank1.start(*self.rank1_flags)
        wait_for(lambda: self.ready().status_code == 200
                 and not self.rank0.status()["tensor"]["standin"], BACK_S,
                 "/ready 200 from the group, its stand-in gone", every=0.5)
        text = self.complete()
        self.daemons.note(self.rank0)
        self.daemons.note(self.rank1)
        return text

    def ready(self) -> httpx.Response:
        return httpx.get(f"{self.url.removesuffix('/v1')}/ready", timeout=10)


@pytest.fixture(scope="module")
def group(fixture_dir: Path) -> Iterator[Group]:
    daemons = Daemons()
    try:
        model = fixture_dir / "llama"
        agent0, agent1, port = free_port(RANK0), free_port(RANK1), free_port(RANK0)
        rank0, rank1 = (daemons.make(FAST_POLICY, name=n) for n in ("tp0", "tp1"))
        common = ("--model", str(model))
        rank1_flags = (*common, "--agent-addr", f"{RANK1}:{agent1}", "--cluster-secret-file",
                       str(secret_file(rank1.root, SECRET)),
                       "--node-role", "tensor_parallel_rank")
        rank0.start(*common, "--agent-addr", f"{RANK0}:{agent0}", "--cluster-secret-file",
                    str(secret_file(rank0.root, SECRET)), "--host", RANK0, "--port",
                    str(port), "--tp-size", "2", "--tp-peers", f"{RANK1}:{agent1}")
        url = f"http://{RANK0}:{port}/v1"
        waiting = wait_for(lambda: (d := down(url)) and "rank 1" in d["reason"] and d, 30,
                           "/ready 503 naming rank 1 before its host is up", every=0.2)
        rank1.start(*rank1_flags)
        yield Group(daemons, rank0, rank1, rank1_flags, url, model,
                    {str(t): -100 for t in eos_ids(model)}, waiting)
    finally:
        daemons.end()


def down(url: str) -> dict[str, Any] | None:
    """``/ready``'s body while it is 503 with a reason (the stand-in's), else None."""
    try:
        got = httpx.get(f"{url.removesuffix('/v1')}/ready", timeout=10)
    except httpx.HTTPError:
        return None
    return got.json() if got.status_code == 503 and "reason" in got.json() else None


def test_ready_names_the_rank_host_until_the_group_forms(group: Group) -> None:
    reason = group.waiting["reason"]
    assert reason.startswith(f"tensor-parallel rank 1 on host {RANK1}:"), reason
    assert "its agent did not take 'tensor_reserve'" in reason, reason


def test_greedy_completions_are_mlx_lms_on_the_whole_model(group: Group) -> None:
    assert group.serves() == expected(group.model, PROMPT, 8)
    assert group.ready().status_code == 200


def test_status_shows_the_group_on_rank_0_and_the_rank_on_its_host(group: Group) -> None:
    tensor = group.rank0.status()["tensor"]
    assert tensor["state"] == "formed" and tensor["size"] == 2, tensor
    zero, one = tensor["ranks"]
    assert zero["rank"] == 0 and zero["ring"].startswith(f"{RANK0}:"), zero
    assert zero["state"] == "running", zero
    assert one["rank"] == 1 and one["agent"].startswith(f"{RANK1}:"), one
    assert one["ring"].startswith(f"{RANK1}:") and one["state"] == "joined", one
    names = {w["name"] for w in group.rank0.status()["workers"]}
    assert "router" in names and "tp-1" not in names, names
    mine = group.rank1.status()
    assert mine["tensor"]["rank"] == 1 and mine["tensor"]["ring"] == one["ring"], mine["tensor"]
    assert mine["tensor"]["rank0"] == zero["ring"], mine["tensor"]
    assert {w["name"] for w in mine["workers"]} == {"tp-1"}, mine["workers"]
    shown = group.rank0.ctl("status")
    assert shown.returncode == 0, shown.stderr
    assert f"rank 1  {one['agent']}" in shown.stdout, shown.stdout
    # Each host's RDMA report (the rank host's came with its tensor_reserved answer): the
    # ring, and why; here no host is a Mac, and rank 0's host is named first.
    transport = tensor["transport"]
    assert transport["backend"] == "ring", transport
    if sys.platform != "darwin":
        assert transport["reason"].startswith(f"{RANK0} is not macOS ({sys.platform})"), transport
    assert f"transport: ring ({transport['reason']})" in shown.stdout, shown.stdout


def stream_until(g: Group, pids: list[int], sig: signal.Signals
                 ) -> tuple[dict[str, Any] | None, float, str]:
    """A long stream; after its first tokens every pid in ``pids`` gets ``sig`` (SIGKILL, or
    SIGSTOP: a host asleep, no RST, its sockets open; each stopped pid gets SIGCONT once the
    stream has ended, whatever happened). The SSE error event (None: none), how long after
    the signal the stream ended, and how."""
    signalled: list[int] = []
    try:
        with httpx.Client(timeout=60) as http, http.stream(
                "POST", f"{g.url}/completions",
                json={"model": "llama", "prompt": "Hello", "max_tokens": 1500,
                      "temperature": 0, "stream": True, "logit_bias": g.banned}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
            for pid in pids:
                os.kill(pid, sig)
                signalled.append(pid)
            at = time.monotonic()
            try:
                for line in lines:
                    if line.startswith("data: {") and '"error"' in line:
                        return (json.loads(line.removeprefix("data: ")),
                                time.monotonic() - at, "an error event")
            except httpx.HTTPError as exc:
                return None, time.monotonic() - at, f"cut: {exc!r}"
        return None, time.monotonic() - at, "ended without an error event"
    finally:
        if sig == signal.SIGSTOP:
            for pid in signalled:
                os.kill(pid, signal.SIGCONT)


def test_a_killed_rank_host_ends_the_stream_and_ready_names_it_until_it_is_back(
        group: Group) -> None:
    group.serves()
    worker = group.rank1.worker("tp-1")["pid"]
    assert worker
    daemon = group.rank1.pid
    error, took, how = stream_until(group, [daemon, worker], signal.SIGKILL)
    assert group.rank1.proc is not None
    group.rank1.proc.wait(10)
    print(f"\nSIGKILL of the rank host: the stream ended after {took:.2f} s with {how}")
    assert error is not None, how
    body = error["error"]
    print(f"its error: {body['message']}")
    assert body["code"] == "engine_unavailable", body
    assert f"tensor-parallel rank 1 (worker tp-1 on {RANK1}) is gone" in body["message"], body
    assert took < ENDED_S, took
    ready = wait_for(lambda: down(group.url), 30, "/ready 503 naming the lost rank host",
                     every=0.5)
    assert f"tensor-parallel rank 1 on host {RANK1}:" in ready["reason"], ready
    refused = httpx.post(f"{group.url}/completions", timeout=10,
                         json={"model": "llama", "prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5", refused.text
    assert refused.json()["error"]["code"] == "tensor_group_down", refused.text
    tensor = group.rank0.status()["tensor"]
    assert tensor["state"] == "down" and tensor["ranks"][1]["state"] == "lost", tensor

    group.rank1.start(*group.rank1_flags)  # as a service manager would
    assert group.serves() == expected(group.model, PROMPT, 8)
    assert group.ready().status_code == 200
    assert group.rank0.status()["tensor"]["state"] == "formed"


def test_a_rank_host_daemon_restarted_by_its_service_manager_serves_again_soon(
        group: Group) -> None:
    """The rank host's daemon restarted as launchd or systemd do (SIGTERM, then started
    again at once with the same flags): its rank ends with it, rank 0's router exits, and
    the supervisor restarts it over the old ring (FAST_POLICY's backoff, 0.2 s, is mostly
    over before rank 0's daemon looks again, every second), while the new daemon keeps its
    ring end at another port. That router is stopped (it once waited out the ring's 60 s
    there, holding the requests it took), the ring said moved (``tensor.ring_moved``),
    and the group serves the same greedy text again within ``MOVED_S``; meanwhile every
    request is answered (a 503 with Retry-After from the daemon's stand-in, or the
    completion), none held."""
    group.serves()
    since = group.rank0.events()[-1]["id"]
    was = group.rank0.status()["tensor"]["ranks"][1]["ring"]
    want = expected(group.model, PROMPT, 8)
    answers: list[str] = []
    stopped_at = time.monotonic()
    assert group.rank1.terminate() == 0
    group.rank1.start(*group.rank1_flags)

    def served() -> bool:
        at = f"{time.monotonic() - stopped_at:.1f} s"
        try:
            got = httpx.post(f"{group.url}/completions", timeout=HUNG_S, json={
                "model": "llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        except httpx.TimeoutException as exc:
            pytest.fail(f"a request was held {HUNG_S} s at {at}: {exc!r}; before: {answers}")
        except httpx.HTTPError as exc:  # refused for a moment, as the router exits
            answers.append(f"{at}: {exc!r}")
            return False
        answers.append(f"{at}: {got.status_code} {got.text[:200]}")
        if got.status_code == 200:
            return bool(got.json()["choices"][0]["text"] == want)
        assert got.status_code == 503 and got.headers["Retry-After"] == "5", answers
        assert got.json()["error"]["code"] == "tensor_group_down", answers
        return False

    try:
        wait_for(served, MOVED_S, "the group serving again after its rank host's restart",
                 every=0.5)
    except BaseException:
        print(group.rank0.stderr()[-4000:], group.rank1.stderr()[-3000:],
              *answers, sep="\n----\n")
        raise
    took = time.monotonic() - stopped_at
    group.daemons.note(group.rank0)
    group.daemons.note(group.rank1)
    print(f"\nrank host's daemon restarted: the group serves again after {took:.1f} s")
    after = [e for e in group.rank0.events() if e["id"] > since]
    now = group.rank0.status()["tensor"]["ranks"][1]["ring"]
    assert now != was, (was, now)  # the new daemon's ring end: another port
    moved = [e["message"] for e in after if e["kind"] == "tensor.ring_moved"]
    assert moved and f"rank 1 {was} -> {now}" in moved[0], after
    # No router start failed: none waited out its ring's deadline in a ring that moved.
    failed = [e["message"] for e in after if e["kind"] == "worker.backoff"
              and "starting -> backoff" in e["message"]]
    assert not failed, failed


def test_a_silent_rank_host_ends_the_stream_and_the_group_serves_when_it_wakes(
        group: Group) -> None:
    """The rank host's daemon and worker stopped (SIGSTOP) in the middle of a stream: rank
    0's op-link heartbeat names the rank silent within ``SILENT_S``, the stream ends with
    the group's error (no hang), and once the host wakes (SIGCONT) the group serves the
    same greedy text again, with no operator action."""
    group.serves()
    worker = group.rank1.worker("tp-1")["pid"]
    assert worker
    error, took, how = stream_until(group, [group.rank1.pid, worker], signal.SIGSTOP)
    print(f"\nSIGSTOP of the rank host: the stream ended after {took:.2f} s with {how}")
    assert error is not None, how
    body = error["error"]
    print(f"its error: {body['message']}")
    assert body["code"] == "engine_unavailable", body
    assert "tensor-parallel rank 1" in body["message"] and "silent" in body["message"], body
    assert took < SILENT_S, took
    assert group.serves() == expected(group.model, PROMPT, 8)
    assert group.rank0.status()["tensor"]["state"] == "formed"


def test_a_rank_host_of_another_model_is_refused_and_named(fixture_dir: Path,
                                                           daemons: Daemons) -> None:
    """Rank 0's question is answered with a refusal by a rank host that serves another
    model: no router starts, and the port's 503 says why, naming the rank host."""
    agent0, agent1, port = free_port(RANK0), free_port(RANK1), free_port(RANK0)
    rank0, rank1 = (daemons.make(FAST_POLICY, name=n) for n in ("tq0", "tq1"))
    rank1.start("--model", str(fixture_dir / "qwen3"), "--agent-addr", f"{RANK1}:{agent1}",
                "--cluster-secret-file", str(secret_file(rank1.root, SECRET)),
                "--node-role", "tensor_parallel_rank")
    rank0.start("--model", str(fixture_dir / "llama"), "--agent-addr", f"{RANK0}:{agent0}",
                "--cluster-secret-file", str(secret_file(rank0.root, SECRET)), "--host", RANK0,
                "--port", str(port), "--tp-size", "2", "--tp-peers", f"{RANK1}:{agent1}")
    url = f"http://{RANK0}:{port}/v1"
    refused = wait_for(lambda: (d := down(url)) and "another model" in d["reason"] and d, 30,
                       "/ready 503 naming the rank host's other model", every=0.2)
    assert refused["reason"].startswith(f"tensor-parallel rank 1 on host {RANK1}:{agent1} is "
                                        "lost: its agent did not take 'tensor_reserve' (error)"
                                        ": this rank host serves another model"), refused
    assert {w["name"] for w in rank0.status()["workers"]} == set()  # no router: not formed
    assert rank1.status()["tensor"]["state"] == "waiting"
    # A stop (SIGTERM, as launchd or systemd send it) ends rank 0 at once, though its group
    # is between two tries to form: the try and its backoff are cancelled (they once held
    # the stop until the service manager's SIGKILL).
    assert rank0.proc is not None
    rank0.proc.send_signal(signal.SIGTERM)
    assert rank0.proc.wait(STOPPED_S) == 0
