"""``mlxctl chat`` against a real daemon serving the tiny fixture with an API key: piped
lines are turns, the history is kept and ``/reset`` clears it (the router's access log
says how long each prompt was), Ctrl-C stops an answer but not the chat, a reasoning
model's thinking is shown apart and not sent back, and what goes wrong is one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mlxceld.models import preset, write_fixture

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.ports import free_port
from helpers.waiting import wait_for

KEY = "sk-chat-test-0123456789"
CUT = "(cut off: the token limit, see --max-tokens)"
ACCESS = re.compile(r"POST /v1/chat/completions (\d+) prompt_tokens=(\S+) "
                    r"completion_tokens=(\S+)")


@dataclass
class Served:
    daemon: DaemonProc
    url: str
    key_file: Path

    def chat(self, *args: str, lines: str) -> subprocess.CompletedProcess[str]:
        return ctl("--socket", str(self.daemon.socket), "chat", *args, stdin=lines)

    def requests(self) -> list[tuple[int, str, str]]:
        """Every chat completion in the router's access log: status, prompt and
        completion tokens (``-`` where the answer was not whole)."""
        log = self.daemon.ctl("logs", "router", "-n", "10000").stdout
        return [(int(s), p, c) for s, p, c in ACCESS.findall(log)]

    def new_requests(self, before: int, count: int) -> list[tuple[int, str, str]]:
        got: list[tuple[int, str, str]] = wait_for(
            lambda: r if len(r := self.requests()[before:]) >= count else None, 30,
            f"{count} chat completions in the router's access log")
        return got


def ctl(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    """mlxctl with ``stdin`` piped in (not a terminal: a line a turn)."""
    return subprocess.run([sys.executable, "-m", "mlxctl", *args], input=stdin,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_COLOR": "1", "MLXCELD_SOCKET": ""})


def serve(owner: Daemons, model: Path, name: str) -> Served:
    key_file = Path(owner.make(name=f"{name}-key").root) / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    port = free_port()
    d = owner.make(FAST_POLICY, name=name).start("--model", str(model), "--port", str(port),
                                                 "--api-key-file", str(key_file))
    w = d.wait_worker("router", timeout=READY_S, state="running")
    owner.pids.add(w["pid"])
    return Served(d, f"http://127.0.0.1:{port}/v1", key_file)


@pytest.fixture(scope="module")
def served(fixture_dir: Path) -> Iterator[Served]:
    owner = Daemons()
    try:
        yield serve(owner, fixture_dir / "llama", "chat")
    finally:
        owner.cleanup()


def test_turns_keep_the_history_and_reset_clears_it(served: Served) -> None:
    before = len(served.requests())
    out = served.chat("--max-tokens", "6", "--temperature", "0",
                      lines="hello\nhello\n/reset\nhello\n")
    assert out.returncode == 0, out.stderr
    # A transcript: each turn echoed, an answer after it, the reset said.
    turns = out.stdout.split("> hello\n")
    assert len(turns) == 4 and turns[0] == "", out.stdout
    assert all(t.replace(CUT, "").strip() for t in turns[1:])  # three answers
    assert turns[2].endswith("> /reset\n(history cleared)\n"), out.stdout
    assert KEY not in out.stdout + out.stderr  # the key came from the daemon's file
    assert "chat with llama at " + served.url in out.stderr
    (s1, p1, c1), (s2, p2, c2), (s3, p3, c3) = served.new_requests(before, 3)
    assert (s1, s2, s3) == (200, 200, 200) and min(int(c1), int(c2), int(c3)) > 0
    assert int(p2) > int(p1)  # the second turn carried the first and its answer
    assert p3 == p1  # after /reset, the same question alone again


def test_system_prompt_is_sent_first(served: Served) -> None:
    before = len(served.requests())
    plain = served.chat("--max-tokens", "2", lines="hi\n")
    told = served.chat("--max-tokens", "2", "--system", "You are a terse assistant.",
                       lines="hi\n")
    assert plain.returncode == 0 and told.returncode == 0, plain.stderr + told.stderr
    (_, p_plain, _), (_, p_told, _) = served.new_requests(before, 2)
    assert int(p_told) > int(p_plain)


def test_ctrl_c_stops_the_answer_not_the_chat(served: Served) -> None:
    # Greedy, the fixture's answer to this runs for hundreds of tokens before its end of
    # sequence: long enough to be interrupted after its first characters.
    before = len(served.requests())
    # As from a terminal, ^C not ignored (a suite run as a background job ignores SIGINT,
    # and a child inherits that).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxctl", "--socket", str(served.daemon.socket), "chat",
             "--max-tokens", "1500", "--temperature", "0"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "NO_COLOR": "1"})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write("tell me a long story\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "> tell me a long story\n"
        assert proc.stdout.read(8)  # the answer streams
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate("/reset\nagain\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "(stopped)" in rest and "> again" in rest.split("(stopped)", 1)[1]
    (s1, _, c1), (s2, _, _) = served.new_requests(before, 2)
    # The first answer ended early (its stream closed: the access log has no count of a
    # completion cut off), the second was asked after it.
    assert (s1, c1, s2) == (200, "-", 200)


def test_what_goes_wrong_is_one_line_and_an_exit_code(served: Served, daemons: Daemons) -> None:
    # The router's key, not given: refused by name, and the key is never printed.
    keyless = ctl("chat", "--url", served.url, stdin="hi\n")
    assert keyless.returncode == 1
    assert "refused the API key (HTTP 401)" in keyless.stderr and "--api-key-file" in \
        keyless.stderr
    wrong = served.daemon.root / "wrong-key"
    wrong.write_text("sk-not-the-right-one\n")
    wrong.chmod(0o600)
    bad = ctl("chat", "--url", served.url, "--api-key-file", str(wrong), stdin="hi\n")
    assert bad.returncode == 1 and "sk-not-the-right-one" not in bad.stdout + bad.stderr
    # Given by --url and --api-key-file: chats without asking the daemon.
    good = ctl("--socket", "/nonexistent.sock", "chat", "--url", served.url,
               "--api-key-file", str(served.key_file), "--max-tokens", "2", stdin="hi\n")
    assert good.returncode == 0 and good.stdout.startswith("> hi\n"), good.stderr
    # A field the router refuses: one line naming it, that turn dropped, the chat goes on.
    refused = served.chat("--max-tokens", "100000", lines="hi\n/exit\n")
    assert refused.returncode == 0
    assert re.search(r"^mlxctl: the router refused the request \(HTTP 400\): .*max_tokens",
                     refused.stderr, re.M), refused.stderr
    # A model the router does not serve.
    other = served.chat("--model", "nope", lines="hi\n")
    assert other.returncode == 1
    assert "serves no model 'nope' (it serves: llama)" in other.stderr
    # Nothing listens at the URL: exit 1 at once.
    dead = ctl("chat", "--url", f"http://127.0.0.1:{free_port()}/v1", stdin="hi\n")
    assert dead.returncode == 1 and "does not answer" in dead.stderr
    # A daemon that serves nothing; no daemon at all (3).
    idle = daemons.make(FAST_POLICY).start()
    nothing = ctl("--socket", str(idle.socket), "chat", stdin="hi\n")
    assert nothing.returncode == 1 and "serves no model" in nothing.stderr
    assert "mlxctl serve" in nothing.stderr
    gone = ctl("--socket", str(idle.root / "none.sock"), "chat", stdin="hi\n")
    assert gone.returncode == 3


def test_reasoning_is_shown_apart_and_not_sent_back(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    model = write_fixture(tmp_path_factory.mktemp("chat-reasoning") / "qwen3",
                          preset("tiny", layers=4, chat_template="tools"))
    owner = Daemons()
    try:
        s = serve(owner, model, "think")
        before = len(s.requests())
        out = s.chat("--max-tokens", "6", "--temperature", "0", lines="hi\nhi\n")
        assert out.returncode == 0, out.stderr
        # The template opens <think>: the answer is all reasoning, each line marked.
        answers = out.stdout.split("> hi\n")[1:]
        assert len(answers) == 2 and all(a.startswith("thinking: ") for a in answers), out.stdout
        (_, p1, _), (_, p2, _) = s.new_requests(before, 2)
        # The second turn carried the first with an empty answer (no reasoning in it):
        # the same prompt as asked by hand.
        with httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=60) as http:
            usage = http.post(f"{s.url}/chat/completions", json={
                "model": "qwen3", "max_tokens": 1, "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": ""},
                    {"role": "user", "content": "hi"}]}).json()["usage"]
        assert int(p2) == usage["prompt_tokens"] > int(p1)
    finally:
        owner.cleanup()
