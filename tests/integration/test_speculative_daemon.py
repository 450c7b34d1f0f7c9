"""Speculative decoding as users run it: a real daemon with ``--draft-model``, the real
``openai`` client. Greedy text is mlx-lm's own with any draft, one request or several at
once, and mlx-lm's run with the same quantized KV cache with ``--kv-bits``; ``/metrics``
and ``mlxctl status`` show the counters: every proposal of the agreeing pair accepted,
almost none of an unrelated draft's. A tensor-parallel group speculates too (its rank 0
drafts). A pipeline's router refuses a draft by name, and a draft of another tokenizer
keeps the daemon from starting."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from mlx_lm import load

from mlxceld.models.fixtures import preset, write_fixture
from mlxceld.roles.options import (
    EXIT_CONFIG,
    KVQuant,
    PipelineOptions,
    PipelineStage,
    RouterOptions,
)

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.deploy import Host
from helpers.drafts import write_pairs
from helpers.metrics import sample, scrape
from helpers.models import expected, quantized_greedy
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for
from helpers.workers import run_worker

N = 40
STATS_S = 20.0  # a worker's stats reach the daemon's status within a few of its ticks
PROMPTS = ["The quick brown fox", "Hello, world", "Once upon a time", "x y z"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``target/`` (zeroed) and its agreeing ``draft/``; ``other/`` an unrelated draft;
    ``plain/`` a random target whose tokens wander."""
    root = tmp_path_factory.mktemp("speculative")
    write_pairs(root, 3)
    write_fixture(root / "v600", preset("tiny", family="llama", layers=1, vocab=600))
    # heads of 64 elements: a quantized KV cache (kv_bits, groups of 64) fits
    write_fixture(root / "kv", preset("tiny", family="llama", layers=3, head_dim=64))
    return root


def serve(daemons: Daemons, model: Path, draft: Path, *extra: str) -> tuple[str, DaemonProc]:
    port = free_port()
    d = daemons.make(FAST_POLICY).start("--model", str(model), "--port", str(port),
                                        "--draft-model", str(draft), "--num-draft-tokens", "4",
                                        *extra)
    w = d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(w["pid"])
    return f"http://127.0.0.1:{port}/v1", d


def test_an_unrelated_draft_changes_no_token_alone_or_together(daemons: Daemons,
                                                               pair: Path) -> None:
    model = pair / "plain"
    url, d = serve(daemons, model, pair / "other")
    want = {p: expected(model, p, N) for p in PROMPTS}
    with client(url) as c:
        def complete(prompt: str) -> str:
            return c.completions.create(model="plain", prompt=prompt, max_tokens=N,
                                        temperature=0).choices[0].text or ""

        alone = {p: complete(p) for p in PROMPTS}
        assert alone == want
        passes = sample(scrape(url), "mlxceld_speculative_passes_total")
        assert passes is not None and passes > 0  # they speculated (then backed off)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = dict(zip(PROMPTS, pool.map(complete, PROMPTS), strict=True))
        assert together == want
    samples = scrape(url)
    rate = sample(samples, "mlxceld_speculative_acceptance_rate")
    assert rate is not None and rate < 0.5, rate
    proposed = sample(samples, "mlxceld_speculative_proposed_total")
    assert proposed is not None and proposed > 0
    wait_for(lambda: "of 0 draft tokens" not in d.ctl("status").stdout,
             STATS_S, "the counters in mlxctl status")
    # `mlxctl serve` of a model the draft does not fit is refused, naming the setting.
    refused = d.ctl("serve", str(pair / "v600"))
    assert refused.returncode == 1, refused
    assert "serve.draft_model: draft model" in refused.stderr, refused.stderr


def test_the_agreeing_pair_accepts_every_proposal(daemons: Daemons, pair: Path) -> None:
    model = pair / "target"
    url, d = serve(daemons, model, pair / "draft")
    with client(url) as c:
        text = c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=N,
                                    temperature=0).choices[0].text
    assert text == expected(model, PROMPTS[0], N)
    samples = scrape(url)
    assert sample(samples, "mlxceld_speculative_acceptance_rate") == 1.0
    per_pass = sample(samples, "mlxceld_speculative_tokens_per_pass")
    assert per_pass is not None and per_pass > 4.0  # k = 4 accepted, and one more
    # The worker's stats are refreshed each tick of its own: as they reach status.
    wait_for(lambda: "draft tokens accepted (100%)" in d.ctl("status").stdout,
             STATS_S, "the counters in mlxctl status")


def test_with_kv_bits_greedy_text_is_mlx_lms_quantized_run(daemons: Daemons,
                                                           pair: Path) -> None:
    """``--kv-bits 4`` with a draft (the model as its own: it proposes in context): the
    text is mlx-lm's greedy run with the same quantized KV cache, and it speculated."""
    model = pair / "kv"
    kv = KVQuant(4, 64, 0)
    m, tok = load(str(model))
    url, _ = serve(daemons, model, model, "--kv-bits", "4")
    full: list[bool] = []
    with client(url) as c:
        for prompt in PROMPTS[:2]:
            tokens, _ = quantized_greedy(m, tok.encode(prompt), N, kv,
                                         set(tok.eos_token_ids))
            detokenizer = tok.detokenizer  # as mlx_lm.generate gives its text
            detokenizer.reset()
            for t in tokens:
                if t not in tok.eos_token_ids:
                    detokenizer.add_token(t)
            detokenizer.finalize()
            want = detokenizer.text
            text = c.completions.create(model="kv", prompt=prompt, max_tokens=N,
                                        temperature=0).choices[0].text
            assert text == want, prompt
            full.append(text != expected(model, prompt, N))
    assert any(full)  # 4 bits: not full precision's text
    samples = scrape(url)
    passes = sample(samples, "mlxceld_speculative_passes_total")
    accepted = sample(samples, "mlxceld_speculative_accepted_total")
    assert passes is not None and passes > 0 and accepted is not None and accepted > 0


def test_a_draft_of_another_tokenizer_keeps_the_daemon_from_starting(
        daemons: Daemons, pair: Path) -> None:
    d = daemons.make(FAST_POLICY).start("--model", str(pair / "plain"), "--draft-model",
                                        str(pair / "v600"), wait=False)
    assert d.proc is not None
    assert d.proc.wait(timeout=60) == 2
    err = d.stderr_path.read_text()
    assert "--draft-model: draft model" in err and "vocabulary of 600 tokens" in err, err


def test_a_pipeline_router_refuses_a_draft_by_name(state_dir: Path, pair: Path) -> None:
    pipe = PipelineOptions(stages=(PipelineStage("s0", "127.0.0.1:9", 0, (0, 3)),),
                           coordinator="127.0.0.1:8", model_identity="ab" * 32, cluster="c")
    options = RouterOptions(model=str(pair / "plain"), model_name="m", host="127.0.0.1",
                            port=free_port("127.0.0.1"), max_batch=2, max_queued=2,
                            pipeline=pipe, draft_model=str(pair / "other"))
    code, summary, log = run_worker(state_dir, "router", options)
    assert code == EXIT_CONFIG, log
    assert "serve.draft_model: speculative decoding is built for the local engine only" \
        in summary, summary




def test_a_tensor_group_speculates_from_its_config_file(daemons: Daemons, pair: Path) -> None:
    """``[serve] tp_size = 2`` and ``draft_model`` in the config file, as a service is
    configured: rank 0 (the router) drafts, both ranks verify; greedy text is mlx-lm's
    on the whole model, alone and with others at once, and the counters show passes."""
    model = pair / "plain"
    port = free_port()
    host = Host(daemons, "tpspec", secret=None,
                serve={"model": str(model), "port": port, "tp_size": 2,
                       "draft_model": str(pair / "other"), "num_draft_tokens": 3})
    host.start()
    for name in ("router", "tp-1"):
        daemons.pids.add(host.d.wait_worker(name, timeout=READY_S, state="running")["pid"])
    url = f"http://127.0.0.1:{port}/v1"
    want = {p: expected(model, p, N) for p in PROMPTS}
    with client(url) as c:
        def complete(prompt: str) -> str:
            return c.completions.create(model="plain", prompt=prompt, max_tokens=N,
                                        temperature=0).choices[0].text or ""

        assert {p: complete(p) for p in PROMPTS} == want
        passes = sample(scrape(url), "mlxceld_speculative_passes_total")
        assert passes is not None and passes > 0
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = dict(zip(PROMPTS, pool.map(complete, PROMPTS), strict=True))
        assert together == want
    status = host.d.ctl("status").stdout
    assert "tp-1" in status, status
