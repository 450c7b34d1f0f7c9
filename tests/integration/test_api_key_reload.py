"""A leaked API key revoked without a restart: the key file rewritten, then SIGHUP (and
separately `mlxctl reload`), and the router worker refuses the old key at once and takes
the new one, never restarted, a stream begun under the old key run to its end; a
restarted router starts with the new key, and a router adopted by a new daemon is sent
it. The key is in no log, argv, environment or database file. The real ``openai``
client, retries off."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import openai
import pytest

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.models import PROMPT, eos_ids
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

OLD, NEW, NEWER = "sk-old-0123456789", "sk-new-abcdefghij", "sk-newer-klmnopqrst"
RELOAD_S = 20.0  # a SIGHUP's reload done (its event written), on a busy CPU
ADOPTED_S = 10.0  # an adopted router sent its key: health probes every 0.5 s (FAST_POLICY)


@pytest.fixture(scope="module")
def tiny_llama(fixture_dir: Path) -> Path:
    return fixture_dir / "llama"


def write_key(path: Path, key: str) -> None:
    """As an operator replaces a key: a new 0600 file moved over the old one."""
    fresh = path.with_suffix(".new")
    fresh.write_text(key + "\n")
    fresh.chmod(0o600)
    fresh.replace(path)


def answers(url: str, key: str) -> int:
    """The status of a one-token chat under ``key``: 200, or the refusal's."""
    with client(url, key) as c:
        try:
            c.chat.completions.create(model="llama", max_tokens=1,
                                      messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as exc:
            return exc.status_code
    return 200


def reloads(d: DaemonProc) -> int:
    return sum(e["kind"] == "daemon.reloaded" for e in d.events())


def key_nowhere(d: DaemonProc, router_pid: int, *keys: str) -> None:
    """None of ``keys`` in the daemon's and router's argv and environment, the logs, or
    the state dir's database files."""
    places = [Path(f"/proc/{pid}/{what}") for pid in (d.pid, router_pid)
              for what in ("cmdline", "environ")]
    places += [d.stderr_path, *(d.state_dir / "logs").glob("*")]
    places += list(d.state_dir.glob("state.db*"))
    for place in places:
        data = place.read_bytes()
        for key in keys:
            assert key.encode() not in data, f"the API key is in {place}"


@pytest.mark.slow  # about 10 s: a router loaded twice
def test_a_rewritten_key_file_takes_effect_on_sighup_and_on_reload(
        daemons: Daemons, tiny_llama: Path) -> None:
    key_file = Path(daemons.make(name="key").root) / "api-key"
    write_key(key_file, OLD)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    d = daemons.make(FAST_POLICY).start("--model", str(tiny_llama), "--port", str(port),
                                        "--api-key-file", str(key_file))
    router = d.wait_worker("router", timeout=READY_S, state="running")["pid"]
    daemons.pids.add(router)
    assert (answers(url, OLD), answers(url, NEW)) == (200, 401)

    # A stream begun under the old key before the change runs to its end after it.
    with client(url, OLD) as c:
        stream = iter(c.completions.create(
            model="llama", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
            logit_bias={str(t): -100 for t in eos_ids(tiny_llama)}))
        first = next(stream)
        write_key(key_file, NEW)
        before = reloads(d)
        d.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        wait_for(lambda: reloads(d) > before, RELOAD_S, "the SIGHUP's reload")
        assert (answers(url, OLD), answers(url, NEW)) == (401, 200)
        rest = list(stream)
    finishes = [ch.choices[0].finish_reason for ch in (first, *rest) if ch.choices]
    assert finishes[-1] == "length" and len(finishes) >= 100

    write_key(key_file, NEWER)
    done = d.ctl("reload", "--json")
    assert done.returncode == 0, done.stderr
    changed = json.loads(done.stdout)["changed"]
    assert [c["key"] for c in changed] == ["serve.api_key"]
    assert NEW not in done.stdout and NEWER not in done.stdout
    # At once: no wait between the reload's answer and the first request.
    assert (answers(url, NEW), answers(url, NEWER)) == (401, 200)
    assert d.worker("router")["pid"] == router  # never restarted
    key_nowhere(d, router, OLD, NEW, NEWER)

    # A restarted router starts with the key of the last reload.
    restarted = d.ctl("restart", "router")
    assert restarted.returncode == 0, restarted.stderr
    again = wait_for(lambda: (w := d.worker("router"))["pid"] not in (None, router)
                     and w["state"] == "running" and w, READY_S, "the router restarted")["pid"]
    daemons.pids.add(again)
    assert (answers(url, NEW), answers(url, NEWER)) == (401, 200)

    # A daemon killed, the file rewritten meanwhile: the new daemon reads it at start and
    # sends it to the router it adopts (at its first health probes).
    d.proc.kill()  # type: ignore[union-attr]
    d.proc.wait()  # type: ignore[union-attr]
    write_key(key_file, OLD)
    d.start("--model", str(tiny_llama), "--port", str(port), "--api-key-file", str(key_file))
    assert d.worker("router")["pid"] == again  # adopted, not restarted
    wait_for(lambda: answers(url, OLD) == 200, ADOPTED_S, "the adopted router's new key")
    assert answers(url, NEWER) == 401
