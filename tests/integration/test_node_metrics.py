"""``/metrics`` on every daemon (``[daemon] metrics_listen``), scraped from real daemons:
their workers (a SIGSTOPped one read as not answering, the scrape not waiting on it), the
API key and the setting that opens it (changed by a reload), peers' liveness, and a
pipeline stage's counters moving with a completion. Each scrape is checked line by line
(``helpers.metrics.check_exposition``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import httpx

from helpers.daemons import TWO_ECHOS, Daemons
from helpers.metrics import Samples, sample, scrape_checked
from helpers.pipeline import start_pipeline
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

KEY = "sk-metrics-test"


def listen(name: str = "localhost") -> tuple[str, str]:
    """A ``metrics_listen`` value on a free port (by host name: honoured) and its URL."""
    ip = "127.0.0.1" if name == "localhost" else name
    port = free_port(ip)
    return f"{name}:{port}", f"http://{ip}:{port}/metrics"


def with_daemon_keys(text: str, **keys: str | bool) -> str:
    rows = "".join(f"{k} = {'true' if v is True else 'false' if v is False else repr(v)}\n"
                   for k, v in keys.items())
    return text + "\n[daemon]\n" + rows


def test_workers_are_shown_and_a_stopped_one_does_not_hang_the_scrape(
        daemons: Daemons) -> None:
    address, url = listen()
    d = daemons.make(with_daemon_keys(TWO_ECHOS, metrics_listen=address)).start()
    beta = d.wait_worker("beta", state="running")["pid"]
    daemons.pids.add(beta)
    d.wait_worker("alpha", state="running")
    m = scrape_checked(url)
    assert sample(m, "mlxceld_node_info", node_id=d.status()["daemon"]["node_id"],
                  hostname=d.status()["daemon"]["hostname"]) == 1
    for name in ("alpha", "beta"):
        assert sample(m, "mlxceld_worker_up", worker=name, role="echo") == 1
        assert sample(m, "mlxceld_worker_scrape_ok", worker=name, role="echo") == 1
        assert sample(m, "mlxceld_worker_restarts_total", worker=name, role="echo") == 0
    os.kill(beta, signal.SIGSTOP)  # its control channel accepts, and never answers
    try:
        def stuck() -> Samples | None:
            started = time.monotonic()
            got = scrape_checked(url)  # httpx's deadline fails the test if it hangs
            took.append(time.monotonic() - started)
            return got if sample(got, "mlxceld_worker_scrape_ok", worker="beta",
                                 role="echo") == 0 else None

        took: list[float] = []
        m = wait_for(stuck, 20, "beta's scrape_ok 0", every=0.1)
        assert sample(m, "mlxceld_worker_scrape_ok", worker="alpha", role="echo") == 1
        assert sample(m, "mlxceld_worker_up", worker="alpha", role="echo") == 1
    finally:
        with contextlib.suppress(ProcessLookupError):  # its supervisor may have ended it
            os.kill(beta, signal.SIGCONT)
    assert max(took) < 15, took  # bounded by the per-worker deadline (0.5 s), generously


def test_the_key_guards_metrics_until_a_reload_opens_them(daemons: Daemons) -> None:
    address, url = listen("127.0.0.1")
    d = daemons.make(name="k")
    key_file = d.root / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    config = with_daemon_keys(TWO_ECHOS, metrics_listen=address) + \
        f'\n[serve]\napi_key_file = "{key_file}"\n'
    d.config.write_text(config)
    d.start()
    d.wait_worker("alpha", state="running")
    refused = httpx.get(url, timeout=10)
    assert refused.status_code == 401, refused.text
    assert "API key" in refused.json()["error"]["message"]
    assert sample(scrape_checked(url, KEY), "mlxceld_worker_up", worker="alpha",
                  role="echo") == 1
    d.config.write_text(config + "metrics_require_key = false\n")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: httpx.get(url, timeout=10).status_code == 200, 20,
             "/metrics open after the reload")
    scrape_checked(url)


DETECTOR = """
[daemon]
peer_ping_interval_s = 0.25
peer_suspect_after_s = 1.0
peer_dead_after_s = 2.0
"""


def test_peers_liveness_is_shown(daemons: Daemons) -> None:
    import secrets as random_secrets

    from helpers.cluster import agent, start
    from helpers.keys import secret_file

    secret = random_secrets.token_hex(16).encode()
    b = start(daemons, "127.0.0.2", secret, name="b")
    c = start(daemons, "127.0.0.3", secret, name="c")
    pb, pc = agent(b), agent(c)
    address, url = listen()
    a = daemons.make(DETECTOR + f'metrics_listen = "{address}"\n', name="a")
    a.start("--cluster-secret-file", str(secret_file(a.root, secret)),
            "--agent-addr", "127.0.0.1:0", "--cluster-peers", f"{pb},{pc}")

    def alive(peer: str, value: int) -> Samples | None:
        m = scrape_checked(url)
        got = [v for (name, labels), v in m.items()
               if name == "mlxceld_peer_alive" and ("peer", peer) in labels]
        return m if got == [value] else None

    m = wait_for(lambda: alive(pb, 1) and alive(pc, 1), 30, "both peers alive", every=0.2)
    assert sample(m, "mlxceld_peers_known") == 2
    assert b.proc is not None
    os.kill(b.pid, signal.SIGSTOP)
    try:
        m = wait_for(lambda: alive(pb, 0), 30, f"{pb} not alive", every=0.2)
        states = {dict(labels)["state"]: v for (name, labels), v in m.items()
                  if name == "mlxceld_peer_state" and ("peer", pb) in labels}
        assert sum(states.values()) == 1 and states["alive"] == 0, states
        assert alive(pc, 1) is not None
    finally:
        os.kill(b.pid, signal.SIGCONT)
    wait_for(lambda: alive(pb, 1), 30, f"{pb} alive again", every=0.2)


def stage_sample(url: str, name: str, stage: str, layers: str, **more: str) -> float:
    return sample(scrape_checked(url), name, worker="stage", stage=stage, layers=layers,
                  **more) or 0


def test_a_stage_hosts_daemon_shows_its_stage_moving(daemons: Daemons,
                                                     split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "qwen3"
    urls = {}
    extra = {}
    for rank in (0, 1):
        address, urls[rank] = listen(f"127.0.0.{2 + rank}")
        extra[rank] = {"metrics_listen": address}
    pipe = start_pipeline(daemons, model, [(0, 2), (2, 4)], stage_daemon=extra)
    m = scrape_checked(urls[0])
    assert sample(m, "mlxceld_worker_up", worker="stage", role="stage") == 1
    assert sample(m, "mlxceld_worker_scrape_ok", worker="stage", role="stage") == 1
    before = stage_sample(urls[0], "mlxceld_stage_steps_total", "stage-0", "0-2")
    prompt = "The quick brown fox"
    with client(pipe.url) as c:
        text = c.completions.create(model="qwen3", prompt=prompt, max_tokens=8,
                                    temperature=0).choices[0].text
        wait_for(lambda: stage_sample(urls[0], "mlxceld_stage_steps_total", "stage-0",
                                      "0-2") > before, 30, "stage-0's steps moved",
                 every=0.3)
        # Each worker refreshes its stats every second, each on its own clock.
        wait_for(lambda: stage_sample(urls[1], "mlxceld_stage_tokens_total", "stage-1",
                                      "2-4") > 0, 30, "stage-1's tokens counted", every=0.3)
        c.completions.create(model="qwen3", prompt=prompt + text + " and then",
                             max_tokens=4, temperature=0)
    hits = wait_for(lambda: (sample(m := scrape_checked(urls[1]),
                                    "mlxceld_prompt_cache_hits_total", worker="stage") or 0)
                    >= 1 and m, 30, "stage-1's prompt cache hit", every=0.3)
    assert (sample(hits, "mlxceld_prompt_cache_bytes", worker="stage") or 0) > 0
    rtt = wait_for(lambda: stage_sample(urls[0], "mlxceld_stage_onward_rtt_seconds",
                                        "stage-0", "0-2", link="next") or None, 30,
                   "stage-0's round trip to stage-1", every=0.3)
    assert rtt > 0


def test_a_port_in_use_fails_the_start_naming_the_setting(daemons: Daemons) -> None:
    address, _ = listen("127.0.0.1")
    host, port = address.rsplit(":", 1)
    with socket.create_server((host, int(port))):
        d = daemons.make(with_daemon_keys(TWO_ECHOS, metrics_listen=address))
        d.start(wait=False)
        assert d.proc is not None and d.proc.wait(timeout=60) == 1
    said = d.stderr()
    assert f"cannot serve /metrics on {address} ([daemon] metrics_listen" in said, said
    assert "Address already in use" in said and "pick a free port" in said
