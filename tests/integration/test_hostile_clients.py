"""Hostile clients against a real router worker (a real daemon serving a tiny fixture
model): thousands of idle connections and slowloris heads, heads too large or doubly
framed, prompts of MBs. The router keeps answering ``/health`` and serving completions,
its log grows by lines, not MBs, and its memory comes back.

The fixture's context is 65,536 tokens, so that a 2 MB prompt fits its bytes bound
(32 bytes a token) and is tokenized (in the large-prompt thread) before its tokens
refuse it, while a 4 MB one is refused by its bytes at once."""

from __future__ import annotations

import contextlib
import json
import resource
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from mlxceld.guard.connections import ACCEPT_BATCH, MAX_HEADER_LINE_BYTES, MAX_HEADERS
from mlxceld.models import preset, write_fixture

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.models import PROMPT
from helpers.ports import free_port
from helpers.probe import HealthProbe, waiting_to_be_accepted
from helpers.router import client
from helpers.waiting import wait_for

IDLE = 2000  # connections that never send a byte
SLOW = 500  # connections sending their head a byte a second
HEADER_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 1024
CONTEXT = 65536
CONFIG = FAST_POLICY + f"""
[serve]
header_timeout_s = {HEADER_TIMEOUT_S}
max_connections = {MAX_CONNECTIONS}
"""
LOREM = "lorem ipsum dolor sit amet "


@dataclass
class Router:
    daemon: DaemonProc
    port: int
    pid: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.daemon.state_dir / "logs" / "router.log"

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def unharmed(self) -> None:
        w = self.daemon.worker("router")
        assert w["state"] == "running" and w["pid"] == self.pid and w["restarts"] == 0, w


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    model = tmp_path_factory.mktemp("long-context") / "llama"
    write_fixture(model, preset("tiny", family="llama", context=CONTEXT))
    owner = Daemons()
    try:
        port = free_port()
        d = owner.make(CONFIG, name="hostile").start("--model", str(model), "--port", str(port))
        w = d.wait_worker("router", timeout=READY_S, state="running")
        owner.pids.add(w["pid"])
        yield Router(d, port, w["pid"])
    finally:
        owner.cleanup()


@contextlib.contextmanager
def file_limit(needed: int) -> Iterator[None]:
    """This process's soft file limit at least ``needed`` while inside; skip the test if
    the hard limit will not allow it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the test needs {needed} descriptors; the hard file limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_connections(port: int, count: int, into: list[socket.socket],
                     batch: int = 64) -> None:
    """``count`` more connections to ``port`` in ``into``, ``batch`` at a time, each
    connected (or refused) before the next batch; 30 s at most a batch."""
    with selectors.DefaultSelector() as selector:
        while count > 0:
            pending = []
            for _ in range(min(batch, count)):
                s = socket.socket()
                into.append(s)
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                selector.register(s, selectors.EVENT_WRITE)
                pending.append(s)
            count -= len(pending)
            deadline = time.monotonic() + 30
            while selector.get_map() and time.monotonic() < deadline:
                for key, _ in selector.select(1):
                    selector.unregister(key.fileobj)
            for s in pending:
                with contextlib.suppress(KeyError):
                    selector.unregister(s)


class Closings:
    """Watches non-blocking sockets until the server has closed each; keeps what it sent."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        self.received = {s: b"" for s in sockets}
        self.open = set(sockets)

    def __call__(self) -> list[bytes] | None:
        """What the server sent on each, once it has closed them all; else None."""
        for s in list(self.open):
            try:
                while chunk := s.recv(4096):
                    self.received[s] += chunk
            except BlockingIOError:
                continue
            except OSError:  # reset
                pass
            self.open.discard(s)
        return None if self.open else list(self.received.values())


def test_a_flood_of_idle_and_slowloris_connections_leaves_the_router_serving(
        router: Router) -> None:
    log_before = router.log_size()
    worker = psutil.Process(router.pid)
    own_fds = worker.num_fds()  # the model, the log, the sockets of its own
    sockets: list[socket.socket] = []
    dripping = threading.Event()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 60

    def drip(slow: list[socket.socket]) -> None:  # a byte of the head a second on each
        for i in range(len(head)):
            for s in slow:
                with contextlib.suppress(OSError):
                    s.send(head[i:i + 1])
            if dripping.wait(1):
                return

    # Asked once the connections are open: while they open as fast as the kernel
    # takes them, its accept queue overflows, and a probe's SYN may wait for its
    # retransmission (bench/hostile_http.py measures that phase too).
    probe = HealthProbe("127.0.0.1", router.port)
    dripper: threading.Thread | None = None
    with file_limit(IDLE + SLOW + 256):
        try:
            open_connections(router.port, IDLE, sockets)
            slow: list[socket.socket] = []
            open_connections(router.port, SLOW, slow)
            sockets += slow
            dripper = threading.Thread(target=drip, args=(slow,), daemon=True)
            dripper.start()
            # The cap, and a batch or two accepted at once before the cap closes them. On a
            # busy CPU the closing may lag the accepting a moment: the count must come down
            # to that within 1 s (well before HEADER_TIMEOUT_S would close the idle ones).
            bound = own_fds + MAX_CONNECTIONS + 2 * ACCEPT_BATCH
            seen: list[int] = []

            def capped() -> int | None:
                seen.append(worker.num_fds())
                return seen[-1] if seen[-1] <= bound else None

            held = wait_for(capped, 1.0, f"the router to hold at most {bound} descriptors")
            # And once the kernel holds none of the flood's connections still to accept: a
            # probe's SYN that finds the accept queue full waits out the kernel's 1 s
            # retransmission, whatever the router does. On a busy CPU the router's accept
            # loop may be that far behind the cap's closing.
            settled: list[int | None] = []

            def accepted_all() -> bool:
                settled.append(waiting_to_be_accepted(router.port))
                return settled[-2:] in ([0, 0], [None])

            wait_for(accepted_all, 30, "the router to accept every connection the "
                     "kernel holds for it", every=0.25)
            with probe.running():
                with client(f"{router.url}/v1") as c:
                    choice = c.completions.create(model="llama", prompt=PROMPT,
                                                  max_tokens=4, temperature=0).choices[0]
                began = time.monotonic()
                answers = wait_for(Closings(slow), HEADER_TIMEOUT_S + 60,
                                   "the router to close every slowloris connection",
                                   every=0.2)
                closed_after = time.monotonic() - began
        finally:
            dripping.set()
            if dripper is not None:
                dripper.join(10)
            for s in sockets:
                s.close()
    probe.check(within=1.0, at_least=5)
    assert choice.finish_reason in ("length", "stop") and isinstance(choice.text, str)
    assert held <= bound, f"the router held {held} descriptors"
    # Each slow head was refused at its deadline (408), or closed over the cap (503).
    statuses = {a.split(b" ", 2)[1] for a in answers if a}
    assert statuses <= {b"408", b"503"}, answers[:3]
    assert closed_after < HEADER_TIMEOUT_S + 60
    logged = router.log_since(log_before)
    assert len(logged) < 4096 and logged.count("\n") <= 10, logged[-4096:]
    router.unharmed()


def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``request`` on a new connection and read until the router closes it: the
    status and the JSON error."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        with contextlib.suppress(OSError):  # it may answer and close before taking it all
            s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_large_heads_are_431_and_a_doubly_framed_body_400_in_openai_json(
        router: Router) -> None:
    log_before = router.log_size()
    long_line = (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000
                 + b"\r\n\r\n")
    crowded = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 10_000 + b"\r\n"
    framed = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    for request, status, says in ((long_line, 431, str(MAX_HEADER_LINE_BYTES)),
                                  (crowded, 431, f"more than {MAX_HEADERS} headers"),
                                  (framed, 400, "Transfer-Encoding")):
        got, body = raw_exchange(router.port, request)
        assert got == status, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and says in error["message"]
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    assert router.log_since(log_before).count("\n") <= 3
    router.unharmed()


def test_prompts_of_mbs_are_refused_while_health_answers(router: Router) -> None:
    worker = psutil.Process(router.pid)
    rss_before = worker.memory_info().rss
    answers: dict[str, httpx.Response] = {}
    # 2 MB: within the bytes bound, tokenized (seconds), then refused by its tokens.
    # 4 MB: beyond it, refused at once.
    prompts = {"2 MB": (LOREM * 80_000)[:2_000_000], "4 MB": (LOREM * 160_000)[:4_000_000]}

    def send() -> None:
        for name, prompt in prompts.items():
            answers[name] = httpx.post(f"{router.url}/v1/completions", timeout=120,
                                       json={"model": "llama", "prompt": prompt,
                                             "max_tokens": 4})

    sender = threading.Thread(target=send)
    probe = HealthProbe("127.0.0.1", router.port, every=0.05)
    with probe.running():
        sender.start()
        sender.join(120)
    probe.check(within=0.5, at_least=5)
    for name, says in (("2 MB", f"this model's maximum context length is {CONTEXT} tokens"),
                       ("4 MB", "the prompt is 4000000 bytes long")):
        answer = answers[name]
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert says in error["message"], error
    grew = worker.memory_info().rss - rss_before
    assert grew < 128 << 20, f"the router's memory grew by {grew >> 20} MiB and stayed"
    router.unharmed()
