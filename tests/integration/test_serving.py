"""A real daemon serving a real (tiny, random) model to the real `openai` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons, alive
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for


@pytest.fixture(scope="module")
def tiny_llama(fixture_dir: Path) -> Path:
    return fixture_dir / "llama"


def start_serving(daemons: Daemons, model: Path, *extra: str,
                  config: str = FAST_POLICY) -> tuple[DaemonProc, str]:
    port = free_port()
    d = daemons.make(config).start("--model", str(model), "--port", str(port), *extra)
    w = d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(w["pid"])
    return d, f"http://127.0.0.1:{port}/v1"


def test_chat_and_completions_streamed_and_not(daemons: Daemons, tiny_llama: Path) -> None:
    d, url = start_serving(daemons, tiny_llama)
    with client(url) as c:
        models = c.models.list()
        assert [m.id for m in models.data] == ["llama"]
        chat = c.chat.completions.create(model="llama", max_tokens=8, temperature=0,
                                         messages=[{"role": "user", "content": "Hello there"}])
        choice = chat.choices[0]
        assert choice.message.role == "assistant"
        assert chat.usage is not None and chat.usage.prompt_tokens > 0
        assert chat.usage.completion_tokens <= 8
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
        assert choice.finish_reason in ("stop", "length")
        stream = c.chat.completions.create(
            model="llama", max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Hello there"}])
        pieces, usage = [], None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                pieces.append(ch.delta.content or "")
        assert "".join(pieces) == choice.message.content  # greedy: same text both ways
        assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
        comp = c.completions.create(model="llama", prompt=PROMPT, max_tokens=24,
                                    temperature=0)
        assert comp.choices[0].finish_reason in ("stop", "length")
        assert comp.usage is not None and comp.usage.completion_tokens <= 24
    # Greedy decoding through the daemon gives what mlx_lm.generate gives.
    assert comp.choices[0].text == expected(tiny_llama, PROMPT, 24)
    status = d.status()
    assert status["serving"]["model_name"] == "llama"
    assert status["serving"]["url"] == url


def test_max_tokens_and_stop_strings(daemons: Daemons, tiny_llama: Path) -> None:
    _, url = start_serving(daemons, tiny_llama)
    with client(url) as c:
        full = c.completions.create(model="llama", prompt="def main():", max_tokens=16,
                                    temperature=0)
        text = full.choices[0].text
        assert full.usage is not None
        if full.choices[0].finish_reason == "length":
            assert full.usage.completion_tokens == 16
        if len(text) >= 4:
            stop = text[2:4]
            cut = c.completions.create(model="llama", prompt="def main():", max_tokens=16,
                                       temperature=0, stop=[stop])
            assert cut.choices[0].text == text[: text.index(stop)]
            assert cut.choices[0].finish_reason == "stop"


def test_api_key_accepted_and_refused(daemons: Daemons, tiny_llama: Path) -> None:
    key_file = Path(daemons.make().root) / "api-key"
    key_file.write_text("sk-test-abcdefgh\n")
    key_file.chmod(0o600)
    d, url = start_serving(daemons, tiny_llama, "--api-key-file", str(key_file))
    with client(url, "sk-test-abcdefgh") as good:
        assert good.models.list().data[0].id == "llama"
    with client(url, "wrong-key") as bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(url.replace("/v1", "/health")).status_code == 200  # /health needs no key
    worker_env = Path(f"/proc/{d.worker('router')['pid']}/environ").read_bytes()
    assert b"sk-test-abcdefgh" not in worker_env


def test_concurrent_streams_and_a_disconnect(daemons: Daemons, tiny_llama: Path) -> None:
    _, url = start_serving(daemons, tiny_llama)
    prompts = [f"Story number {i}:" for i in range(8)]
    with client(url) as c:
        expected = [c.completions.create(model="llama", prompt=p, max_tokens=12,
                                         temperature=0).choices[0].text for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            with client(url) as c:
                out = c.completions.create(model="llama", prompt=prompts[i], max_tokens=12,
                                           temperature=0, stream=True)
                results[i] = "".join(ch.choices[0].text for ch in out if ch.choices)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def disconnect() -> None:
        with httpx.stream("POST", f"{url}/completions", json={
                "model": "llama", "prompt": "Never finish", "max_tokens": 2000,
                "stream": True}, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n > 3:
                    return  # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    threads.append(threading.Thread(target=disconnect))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[i] for i in range(8)] == expected
    metrics = httpx.get(url.replace("/v1", "/metrics")).text
    wait_for(lambda: _gauge(httpx.get(url.replace("/v1", "/metrics")).text, "active") == 0,
             20, f"no active sequences left after the disconnect:\n{metrics[-2000:]}")


def _gauge(metrics: str, word: str) -> float | None:
    for line in metrics.splitlines():
        if not line.startswith("#") and word in line.split("{")[0].split(" ")[0]:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_kill9_router_is_restarted_and_serves_again(daemons: Daemons, tiny_llama: Path) -> None:
    d, url = start_serving(daemons, tiny_llama)
    pid = d.worker("router")["pid"]
    os.kill(pid, signal.SIGKILL)
    w = wait_for(lambda: (x := d.worker("router"))["state"] == "running" and x["pid"] != pid
                 and x, READY_S, "router restarted")
    daemons.pids.add(w["pid"])
    with client(url) as c:
        assert c.completions.create(model="llama", prompt="Hi", max_tokens=3).choices


def test_mlxctl_serve_switches_the_model(daemons: Daemons, fixture_dir: Path) -> None:
    port = free_port()
    d = daemons.make(FAST_POLICY + f"\n[serve]\nport = {port}\n").start()
    assert d.status()["serving"] is None
    out = d.ctl("serve", str(fixture_dir / "qwen3"), "--name", "q,q-alias", timeout=READY_S)
    assert out.returncode == 0, out.stderr
    assert f"serving q at http://127.0.0.1:{port}/v1" in out.stdout
    daemons.note(d)
    with client(f"http://127.0.0.1:{port}/v1") as c:
        assert [m.id for m in c.models.list().data] == ["q", "q-alias"]
    twice = d.ctl("serve", str(fixture_dir / "qwen3"), "--name", "q,q")
    assert twice.returncode == 1 and "names a model twice: q, q" in twice.stderr
    missing = d.ctl("serve", "/nonexistent/model-dir")
    assert missing.returncode == 1
    assert "model directory /nonexistent/model-dir does not exist" in missing.stderr


def test_missing_model_path_is_refused_at_startup(daemons: Daemons) -> None:
    d = daemons.make()
    out = subprocess.run([sys.executable, "-m", "mlxceld", "--config", str(d.config),
                          "--state-dir", str(d.state_dir), "--socket", str(d.socket),
                          "--model", "/no/such/model"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2
    assert "--model: model directory /no/such/model does not exist" in out.stderr


@pytest.mark.slow
def test_unserve_stops_the_router_and_a_restart_serves_nothing(daemons: Daemons,
                                                               tiny_llama: Path) -> None:
    port = free_port()
    d = daemons.make(FAST_POLICY + f"\n[serve]\nport = {port}\n").start()
    nothing = d.ctl("unserve")
    assert nothing.returncode == 0 and "nothing was served" in nothing.stdout
    assert d.ctl("serve", str(tiny_llama), timeout=READY_S).returncode == 0
    daemons.note(d)
    router = d.worker("router")["pid"]
    out = d.ctl("unserve", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"stopped serving llama ({tiny_llama.resolve()})"
    assert "router" not in [w["name"] for w in d.status()["workers"]]
    assert d.status()["serving"] is None and not alive(router)
    assert any(e["kind"] == "serve.stopped" for e in d.events())
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)

    assert d.ctl("stop").returncode == 0 and d.proc is not None and d.proc.wait(30) == 0
    d.start()  # the choice was forgotten: nothing is served again
    assert d.status()["serving"] is None and d.status()["workers"] == []

    # A model from --model (or [serve] model) would be served again by a restart: refused,
    # and nothing changes.
    assert d.ctl("stop").returncode == 0 and d.proc.wait(30) == 0
    d.start("--model", str(tiny_llama), "--port", str(port))
    daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    refused = d.ctl("unserve", "--json")
    assert refused.returncode == 1
    error = json.loads(refused.stdout)["error"]
    assert error["message"] == (f"the model {tiny_llama.resolve()} comes from --model: a "
                                "restart would serve it again, so it is not unserved")
    assert "remove it there" in error["hint"]
    assert d.worker("router")["state"] == "running"


def test_a_pp_peer_reports_no_serving_where_nothing_listens(daemons: Daemons,
                                                            tmp_path: Path) -> None:
    """A --pp-peer runs a stage at most, never a router: status says it serves nothing, and
    `mlxctl serve` (which would wait for a router that never comes) is refused."""
    port = free_port()
    d = daemons.make(FAST_POLICY).start("--pp-peer", "--model", str(tmp_path), "--port",
                                        str(port))
    body = json.loads(d.ctl("status", "--json").stdout)
    assert body["serving"] is None and body["workers"] == []
    text = d.ctl("status")
    assert text.returncode == 0 and "serving" not in text.stdout, text.stdout
    refused = d.ctl("serve", str(tmp_path))
    assert refused.returncode == 1, refused.stderr
    assert "this daemon is a --pp-peer" in refused.stderr and "hint:" in refused.stderr
    assert d.status()["serving"] is None
