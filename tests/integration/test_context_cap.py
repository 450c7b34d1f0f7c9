"""``[serve] context_length`` and ``prompt_cache_bytes`` as an operator runs them: a real
daemon, a real tiny model and the real ``openai`` client. The cap bounds what a request
may ask and what it gets by default, ``/v1/models`` and ``mlxctl status`` say it, and the
prompt cache's reuse shows on ``/metrics`` and in ``mlxctl status``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.metrics import sample, scrape
from helpers.models import SMALL_CONTEXT
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

CONTEXT = SMALL_CONTEXT  # the model's own (conftest's small_context)
CAP = 64
# Greedy from this prompt the fixture runs past 512 tokens without an EOS
# (tests/integration/test_api_ops.py): a completion left unbounded fills the context.
PROMPT = "Once upon a time"
STATS_S = 10.0  # the router's stats reach the daemon within a few health probes



def start(daemons: Daemons, serve: str, *flags: str) -> tuple[DaemonProc, str]:
    port = free_port()
    d = daemons.make(FAST_POLICY + f"\n[serve]\nport = {port}\n{serve}\n").start(*flags)
    w = d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(w["pid"])
    return d, f"http://127.0.0.1:{port}/v1"


def refused(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict)
    return body


def router_stat(d: DaemonProc, key: str, ready: Any = bool) -> Any:
    def found() -> Any:
        value = (d.worker("router").get("stats") or {}).get(key)
        return value if ready(value) else None

    return wait_for(found, STATS_S, f"the router's {key} stat")


def test_the_cap_bounds_every_request_and_shows_where_the_model_does(
        daemons: Daemons, small_context: Path) -> None:
    d, url = start(daemons, f'model = "{small_context}"\ncontext_length = {CAP}')
    with client(url) as c:
        [card] = c.models.list().data
        assert (card.id, card.to_dict()["context_length"]) == ("llama", CAP)
        # Left out, max_tokens is what is left of the cap, not of the model's 600.
        comp = c.completions.create(model="llama", prompt=PROMPT, temperature=0)
        assert comp.usage is not None and comp.choices[0].finish_reason == "length"
        assert comp.usage.prompt_tokens + comp.usage.completion_tokens == CAP
        # A prompt and max_tokens past the cap: 400 naming the field.
        error = refused(lambda: c.completions.create(model="llama", prompt=PROMPT,
                                                     max_tokens=CAP))
        assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
        assert f"maximum context length is {CAP} tokens" in error["message"]
        error = refused(lambda: c.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "tell me a tale " * 20}]))
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
        # The same prompt again: its prefix comes from the prompt cache.
        again = c.completions.create(model="llama", prompt=PROMPT, temperature=0,
                                     max_tokens=8)
        assert again.choices[0].text == comp.choices[0].text[:len(again.choices[0].text)]
        # The usage says so, as OpenAI's does: all of the prompt but its last token.
        assert comp.usage.to_dict()["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    metrics = scrape(url)
    assert sample(metrics, "mlxceld_model_info", model="llama", context_length=str(CAP)) == 1
    assert sample(metrics, "mlxceld_prompt_cache_hits_total") == 1
    assert sample(metrics, "mlxceld_prompt_cache_misses_total") == 1
    assert (sample(metrics, "mlxceld_prompt_cache_tokens_reused_total") or 0) >= 1
    assert (sample(metrics, "mlxceld_prompt_cache_entries") or 0) >= 1
    assert (sample(metrics, "mlxceld_prompt_cache_bytes") or 0) > 0
    router_stat(d, "prompt_cache", lambda s: s and s["hits"] == 1)
    out = d.ctl("status").stdout
    assert f"serving llama (context {CAP} tokens) at {url}" in out, out
    assert "prompt cache: 1 hit, 1 miss, " in out, out


def test_a_cap_above_the_models_serves_the_models_and_no_cache_is_kept(
        daemons: Daemons, small_context: Path) -> None:
    d, url = start(daemons, f'model = "{small_context}"\nprompt_cache_bytes = 0',
                   "--context-length", "100000")
    with client(url) as c:
        assert c.models.retrieve("llama").to_dict()["context_length"] == CONTEXT
        for _ in range(2):
            c.completions.create(model="llama", prompt=PROMPT, temperature=0, max_tokens=4)
    log = (d.state_dir / "logs" / "router.log").read_text()
    assert ("[serve] context_length 100000 is above llama's own context of 600 tokens: "
            "serving 600") in log
    assert router_stat(d, "context_length") == CONTEXT
    metrics = scrape(url)
    assert [sample(metrics, f"mlxceld_prompt_cache_{name}") for name in (
        "hits_total", "misses_total", "entries", "bytes")] == [0, 2, 0, 0]
