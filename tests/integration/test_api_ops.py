"""The OpenAI port as an operator runs it: how long a completion may run (``--max-tokens``),
the access log in both formats (``--log-format``), ``/metrics``' process, build and
model, with a real daemon, a real tiny model
and the real ``openai`` client."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

import mlxceld

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.metrics import sample, scrape
from helpers.models import SMALL_CONTEXT
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

CONTEXT = SMALL_CONTEXT  # conftest's small_context: running to its end stays fast
# Greedy from this prompt, the fixture (context 600) runs past 512 tokens without an EOS
# (checked against mlx-lm's generate_step): it stops at the context's end.
LONG_PROMPT = "Once upon a time"
LOG_WAIT_S = 30.0  # a line is written as the response ends; generous on a loaded machine
KEY = "sk-access-log-secret"
BASE = {"time", "level", "logger", "message"}


def start(daemons: Daemons, model: Path, *extra: str) -> tuple[DaemonProc, str]:
    port = free_port()
    d = daemons.make(FAST_POLICY).start("--model", str(model), "--port", str(port), *extra)
    w = d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(w["pid"])
    return d, f"http://127.0.0.1:{port}/v1"


def access_lines(d: DaemonProc, count: int, parse: Any) -> list[Any]:
    """The router log's first ``count`` access lines, parsed, once there are that many."""
    log = d.state_dir / "logs" / "router.log"

    def found() -> list[Any]:
        lines = [parse(line) for line in log.read_text().splitlines()
                 if "mlxceld.api.access" in line]
        return lines if len(lines) >= count else []

    lines: list[Any] = wait_for(found, LOG_WAIT_S, f"{count} access lines in {log}")
    return lines[:count]


TEXT_LINE = re.compile(r" INFO mlxceld\.api\.access: (?P<method>\S+) (?P<path>\S+) "
                       r"(?P<status>\d+) prompt_tokens=(?P<prompt>\S+) "
                       r"completion_tokens=(?P<completion>\S+) duration_ms=(?P<ms>[\d.]+) "
                       r"request_id=(?P<rid>[0-9a-f]{32}) completion_id=(?P<id>\S+)$")


def test_without_max_tokens_a_completion_runs_to_the_contexts_end(daemons: Daemons,
                                                                    small_context: Path) -> None:
    """Not cut at the old fixed default of 512: what is left of the context. The access
    log (text) has its line, and lines for a refusal and a streamed chat."""
    d, url = start(daemons, small_context)
    with client(url) as c:
        # ~600 tokens: a few seconds alone, more on a loaded machine; 180 s, not the 60 s.
        comp = c.with_options(timeout=180).completions.create(
            model="llama", prompt=LONG_PROMPT, temperature=0)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="llama", prompt="x", extra_body={"echo": True})
        stream = c.chat.completions.create(model="llama", max_tokens=4, stream=True,
                                           messages=[{"role": "user", "content": "hi"}])
        chunks = list(stream)
    assert comp.usage is not None
    said = (comp.choices[0].finish_reason, comp.usage)
    assert comp.choices[0].finish_reason == "length", said
    assert comp.usage.prompt_tokens + comp.usage.completion_tokens == CONTEXT, said
    assert comp.usage.completion_tokens > 512, said
    lines = access_lines(d, 3, str)
    whole, refused, streamed = (TEXT_LINE.search(line) for line in lines)
    assert whole and refused and streamed, lines
    assert (whole["method"], whole["path"], whole["status"]) == ("POST", "/v1/completions", "200")
    assert (int(whole["prompt"]), int(whole["completion"]), whole["id"]) == \
        (comp.usage.prompt_tokens, comp.usage.completion_tokens, comp.id)
    assert (refused["status"], refused["prompt"], refused["id"]) == ("400", "-", "-")
    assert (streamed["path"], streamed["status"], streamed["id"]) == \
        ("/v1/chat/completions", "200", chunks[0].id)
    assert 1 <= int(streamed["completion"]) <= 4, lines
    assert "Once upon" not in (d.state_dir / "logs" / "router.log").read_text()


def test_the_operators_max_tokens_bounds_a_completion(daemons: Daemons,
                                                      small_context: Path) -> None:
    """``--max-tokens``; and with ``--log-format json`` every line of the daemon and the
    router is a JSON object, the access lines with their fields, never the API key."""
    key_file = Path(daemons.make().root) / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    d, url = start(daemons, small_context, "--max-tokens", "20", "--log-format", "json",
                   "--api-key-file", str(key_file))
    with client(url, KEY) as c:
        comp = c.completions.create(model="llama", prompt=LONG_PROMPT, temperature=0)
        assert comp.usage is not None and comp.usage.completion_tokens == 20
        assert comp.choices[0].finish_reason == "length"
        chat = c.chat.completions.create(model="llama", temperature=0, max_tokens=20,
                                         messages=[{"role": "user", "content": "hi"}])
        assert chat.usage is not None and chat.usage.completion_tokens <= 20
        with pytest.raises(openai.BadRequestError) as caught:
            c.chat.completions.create(model="llama", max_completion_tokens=21,
                                      messages=[{"role": "user", "content": "hi"}])
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "max_completion_tokens"
    assert "at most 20 tokens" in error["message"]
    lines = access_lines(d, 3, json.loads)
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("POST", "/v1/completions", 200), ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/chat/completions", 400)]
    first = lines[0]
    assert {"time", "level", "logger", "message", "duration_ms"} <= first.keys()
    assert (first["level"], first["logger"]) == ("INFO", "mlxceld.api.access")
    assert (first["prompt_tokens"], first["completion_tokens"], first["completion_id"]) == \
        (comp.usage.prompt_tokens, 20, comp.id)
    assert len({x["request_id"] for x in lines}) == 3  # each its own x-request-id
    assert first["duration_ms"] > 0
    assert (lines[2]["completion_tokens"], lines[2]["completion_id"]) == (None, None)
    metrics = scrape(url, KEY)
    router_pid = d.worker("router")["pid"]
    proc = psutil.Process(router_pid)
    rss = sample(metrics, "process_resident_memory_bytes")
    assert rss is not None and 0.5 < rss / proc.memory_info().rss < 2
    assert sample(metrics, "process_start_time_seconds") == pytest.approx(proc.create_time(),
                                                                          abs=1)
    assert (sample(metrics, "process_cpu_seconds_total") or 0) > 0
    assert (sample(metrics, "process_open_fds") or 0) > 2
    assert sample(metrics, "mlxceld_model_info", model="llama",
                  context_length=str(CONTEXT)) == 1
    [build] = [labels for name, labels in metrics if name == "mlxceld_build_info"]
    assert dict(build)["version"] == mlxceld.__version__ and dict(build)["mlx_lm"] != "none"
    assert not [name for name, _ in metrics if name.startswith("mlxceld_stage_link")]
    router_log = (d.state_dir / "logs" / "router.log").read_text()
    assert KEY not in router_log
    for text in (router_log, d.stderr()):
        bad = [line for line in text.splitlines() if not line.startswith("{")]
        assert not bad, bad[:5]
        parsed = [json.loads(line) for line in text.splitlines()]
        assert parsed and all(line.keys() >= BASE for line in parsed)
