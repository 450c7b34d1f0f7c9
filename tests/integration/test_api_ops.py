"""The OpenAI port as an operator runs it: how long a completion may run (``--max-tokens``)
with a real daemon, a real tiny model and the real ``openai`` client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.ports import free_port
from helpers.router import client

CONTEXT = 600  # a small context, so that running to its end stays fast (~2 s)
# Greedy from this prompt, the fixture (context 600) runs past 512 tokens without an EOS
# (checked against mlx-lm's generate_step): it stops at the context's end.
LONG_PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def small_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxceld.models import preset, write_fixture

    path = tmp_path_factory.mktemp("small-context") / "llama"
    write_fixture(path, preset("tiny", family="llama", context=CONTEXT))
    return path


def start(daemons: Daemons, model: Path, *extra: str) -> tuple[DaemonProc, str]:
    port = free_port()
    d = daemons.make(FAST_POLICY).start("--model", str(model), "--port", str(port), *extra)
    w = d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(w["pid"])
    return d, f"http://127.0.0.1:{port}/v1"


def test_without_max_tokens_a_completion_runs_to_the_contexts_end(daemons: Daemons,
                                                                    small_context: Path) -> None:
    """Not cut at the old fixed default of 512: what is left of the context."""
    _, url = start(daemons, small_context)
    with client(url) as c:
        comp = c.completions.create(model="llama", prompt=LONG_PROMPT, temperature=0)
    assert comp.usage is not None
    assert comp.choices[0].finish_reason == "length"
    assert comp.usage.prompt_tokens + comp.usage.completion_tokens == CONTEXT
    assert comp.usage.completion_tokens > 512


def test_the_operators_max_tokens_bounds_a_completion(daemons: Daemons,
                                                      small_context: Path) -> None:
    _, url = start(daemons, small_context, "--max-tokens", "20")
    with client(url) as c:
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
