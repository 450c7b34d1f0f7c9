"""A pipeline of real daemons on 127.0.0.1 (coordinator), .2, .3 (stages), each with its
own state dir, driven by the real `openai` client. Each daemon is started as a service
would start it (tests/helpers/pipeline.py, tests/helpers/deploy.py): `--config FILE` only,
naming the cluster TOML and its node there, its agent on the default wildcard host."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers import keys
from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons, alive
from helpers.metrics import sample, scrape
from helpers.models import PROMPT, expected
from helpers.pipeline import SECRET, Pipeline, start_pipeline, write_cluster
from helpers.router import client, growing_prompt
from helpers.waiting import wait_for

LONG_PROMPT = "Hello"  # greedy on the llama split fixture: no end-of-sequence for 800+ tokens
LLAMA_SPLITS = [(0, 2), (2, 4)]


@dataclass
class Shared:
    """The module's llama pipeline and the owner that ends its processes, by pid."""

    pipe: Pipeline
    owner: Daemons


@pytest.fixture(scope="module")
def shared(split_fixture_dir: Path) -> Iterator[Shared]:
    """One two-stage llama pipeline for the tests below that leave it whole: each either
    only reads and serves, or stops a stage and brings it back (saying so). Every other
    test (another model, split or coordinator) brings up its own."""
    owner = Daemons()
    try:
        yield Shared(start_pipeline(owner, split_fixture_dir / "llama", LLAMA_SPLITS), owner)
    finally:
        owner.end()


@pytest.fixture
def llama(shared: Shared) -> Shared:
    """The shared pipeline once whole: /ready 200, both stages attached (a test before may
    have just brought one back)."""
    wait_for(lambda: ready(shared.pipe).status_code == 200, READY_S,
             "the shared pipeline's /ready 200 with both stages", every=0.2)
    return shared


@pytest.mark.parametrize("family,splits", [
    ("qwen3", [(0, 1), (1, 4)]),
    ("llama", [(0, 1), (1, 2), (2, 4)]),
])
def test_greedy_output_equals_mlx_lm(daemons: Daemons, split_fixture_dir: Path, family: str,
                                     splits: list[tuple[int, int]]) -> None:
    model = split_fixture_dir / family
    pipe = start_pipeline(daemons, model, splits)
    with client(pipe.url) as c:
        comp = c.completions.create(model=family, prompt=PROMPT, max_tokens=16,
                                    temperature=0)
        chat = c.chat.completions.create(model=family, max_tokens=8, temperature=0,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert comp.choices[0].text == expected(model, PROMPT, 16)
    assert chat.choices[0].message.content is not None
    status = pipe.coordinator.status()
    assert status["cluster"]["role"] == "coordinator"
    assert status["cluster"]["stages"] == len(splits)
    stage_status = pipe.stages[0].status()
    assert stage_status["cluster"]["layers"] == list(splits[0])
    shown = pipe.stages[0].ctl("status").stdout
    assert (f"cluster test-cluster: node stage-0 (pipeline_stage, layers "
            f"[{splits[0][0]}, {splits[0][1]}))") in shown


def test_a_conversation_reuses_the_stages_prompt_cache_and_answers_as_mlx_lm(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """Each turn the whole conversation again, as a chat UI sends it: every answer is
    mlx-lm's for that prompt, and the stages start each turn from the last one's KV."""
    model = split_fixture_dir / "qwen3"
    pipe = start_pipeline(daemons, model, [(0, 2), (2, 4)])
    cached = growing_prompt(pipe.url, "qwen3", model, PROMPT, 4, 12)
    assert cached[0] == 0 and all(n > 10 for n in cached[1:]), cached
    def said() -> dict[str, Any] | None:  # the router's stats, published every second
        router = pipe.coordinator.worker("router")
        cache = router["stats"].get("prompt_cache") or {}
        return cache if cache.get("hits", 0) + cache.get("misses", 0) == 4 else None

    hits = wait_for(said, 10, "the router's prompt cache stats", every=0.2)
    assert (hits["hits"], hits["misses"], hits["lost"]) == (3, 1, 0), hits
    assert hits["tokens_reused"] > 3 * 10
    view = pipe.coordinator.ctl("status").stdout
    assert "prompt cache: " in view and "3 hits" in view, view
    stage = wait_for(lambda: (w := pipe.stages[1].worker("stage")) and (
        w["stats"].get("prompt_cache") or {}).get("hits") == 3 and w, 10,
        "stage-1's prompt cache stats", every=0.2)
    assert stage["stats"]["prompt_cache"]["bytes"] > 0
    assert (sample(scrape(pipe.url), "mlxceld_stage_prompt_cache_bytes", stage="stage-1",
                   layers="2-4") or 0) > 0


def test_four_concurrent_streams_are_all_correct(daemons: Daemons,
                                                 bf16_split_fixture_dir: Path) -> None:
    """In bfloat16, where rounding shows: batched on the stages, each stream still gets
    mlx-lm's text for its prompt alone."""
    model = bf16_split_fixture_dir / "llama"
    pipe = start_pipeline(daemons, model, [(0, 2), (2, 4)])
    prompts = ["The quick brown fox", "Once upon a time", "Hello", "1 2 3 4"]
    results: dict[str, str] = {}

    def one(prompt: str) -> None:
        with client(pipe.url) as c:
            stream = c.completions.create(model="llama", prompt=prompt, max_tokens=24,
                                          temperature=0, stream=True)
            results[prompt] = "".join(ch.choices[0].text for ch in stream if ch.choices)

    threads = [threading.Thread(target=one, args=(pr,)) for pr in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {pr: expected(model, pr, 24) for pr in prompts}


def test_kill9_of_a_stage_fails_the_stream_then_recovers(llama: Shared,
                                                         split_fixture_dir: Path) -> None:
    """On the shared pipeline: it ends whole again (stage-1's daemon runs a new worker)."""
    model = split_fixture_dir / "llama"
    pipe = llama.pipe
    victim = pipe.stages[1].worker("stage")
    with client(pipe.url) as c:
        stream = c.completions.create(model="llama", prompt=LONG_PROMPT, max_tokens=1500,
                                      temperature=0, stream=True)
        started = None
        error = None
        try:
            for i, _chunk in enumerate(stream):
                if i == 3:
                    os.kill(victim["pid"], signal.SIGKILL)
                    started = time.monotonic()
        except openai.APIError as exc:
            error = exc
        assert started is not None, "the stream ended before the stage was killed"
        elapsed = time.monotonic() - started
        # The router sends an SSE error event naming the stage, then ends the stream.
        assert error is not None and "stage-1" in str(error), error
        assert elapsed < 15
        # Its sockets close as it exits, which can be a moment before it is reaped.
        wait_for(lambda: not alive(victim["pid"]), 10, "the killed stage worker gone")
        # The router can notice before the stage's daemon does: wait for the new worker.
        def restarted() -> dict[str, Any] | None:
            w = pipe.stages[1].worker("stage")
            return w if w["state"] == "running" and w["pid"] != victim["pid"] else None

        w = wait_for(restarted, READY_S, "the stage's daemon to run a new stage worker")
        llama.owner.pids.add(w["pid"])

        def answered() -> str | None:
            try:
                return c.completions.create(model="llama", prompt=PROMPT, max_tokens=8,
                                            temperature=0).choices[0].text
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
                return None

        text = wait_for(answered, 60, "a completion after the stage came back", every=0.5)
    assert text == expected(model, PROMPT, 8)


@pytest.mark.slow
def test_request_while_a_stage_is_down_is_503_naming_it(llama: Shared) -> None:
    """On the shared pipeline: stage-1's daemon is stopped, then started again whatever
    the outcome, so that the pipeline is left whole."""
    pipe = llama.pipe
    stage = pipe.stages[1]
    assert stage.proc is not None
    stage.proc.send_signal(signal.SIGTERM)
    stage.proc.wait(30)
    try:
        with client(pipe.url) as c, pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model="llama", prompt=PROMPT, max_tokens=4, temperature=0)
        assert info.value.status_code == 503
        assert "stage-1" in str(info.value)
    finally:
        bring_back(llama, 1)


def test_a_pipeline_without_the_secret_refuses_to_start(daemons: Daemons,
                                                        split_fixture_dir: Path) -> None:
    d = daemons.make(FAST_POLICY, name="ns")
    toml = write_cluster(d.root, split_fixture_dir / "llama", [(0, 2), (2, 4)],
                         secret=False)
    d.start("--distributed-config", str(toml), "--node-id", "stage-0", wait=False)
    assert d.proc is not None
    assert d.proc.wait(30) == 2
    err = d.stderr()
    assert "needs the cluster secret" in err and "--cluster-secret-file" in err


def test_a_layer_gap_is_refused_at_startup(daemons: Daemons, split_fixture_dir: Path) -> None:
    d = daemons.make(FAST_POLICY, name="gap")
    toml = write_cluster(d.root, split_fixture_dir / "llama", [(0, 2), (3, 4)])
    d.start("--distributed-config", str(toml), "--node-id", "stage-0", wait=False)
    assert d.proc is not None
    assert d.proc.wait(30) == 2
    assert "stage-1" in d.stderr() and "layers" in d.stderr()


def bring_back(shared: Shared, rank: int) -> None:
    """Start the shared pipeline's stopped stage ``rank`` again, its worker running (its
    pid noted for the owner's cleanup)."""
    shared.pipe.hosts[rank].start()
    stage = shared.pipe.stages[rank]
    shared.owner.pids.add(stage.wait_worker("stage", timeout=READY_S, state="running")["pid"])


def stage_stats(d: DaemonProc) -> dict[str, object]:
    from mlxceld.supervisor.channel import call
    from mlxceld.supervisor.ops import Stats

    reply = asyncio.run(call(d.state_dir / "workers" / "stage.sock", Stats()))
    stats: dict[str, object] = reply["stats"]
    return stats


def test_a_client_that_leaves_frees_its_sequence_on_every_stage(llama: Shared) -> None:
    pipe = llama.pipe
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{pipe.url}/completions",
            json={"model": "llama", "prompt": LONG_PROMPT, "max_tokens": 1500,
                  "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        held = wait_for(lambda: all(stage_stats(d).get("sequences") == 1
                                    for d in pipe.stages), 10, "the sequence on both stages")
        assert held
    # The response is closed: the router cancels the sequence and releases it everywhere.
    wait_for(lambda: all(stage_stats(d).get("sequences") == 0 for d in pipe.stages), 15,
             "the sequence released on every stage")


def test_a_coordinator_with_another_model_is_refused_naming_both(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    from mlxceld.models import model_identity

    stages_model, other = split_fixture_dir / "llama", split_fixture_dir / "qwen3"
    pipe = start_pipeline(daemons, stages_model, [(0, 2), (2, 4)], {"model": str(other)})
    with client(pipe.url) as c, \
            pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model="qwen3", prompt=PROMPT, max_tokens=4, temperature=0)
    assert info.value.status_code == 503
    message = str(info.value)
    assert model_identity(stages_model) in message and model_identity(other) in message


def test_stages_serve_other_routers_but_no_command_from_a_stage(llama: Shared,
                                                                split_fixture_dir: Path) -> None:
    """Another holder of the secret on 127.0.0.5 (a second router) may connect and attach;
    a stage takes no command from its upstream stage's identity (pipeline/protocol.py) and
    no activation but the upstream stage's."""
    from mlxceld.models import model_identity
    from mlxceld.net import connect
    from mlxceld.pipeline import protocol as p
    from mlxceld.wire import encode_envelope, parse_envelope

    model = split_fixture_dir / "llama"
    pipe = llama.pipe
    text = pipe.toml.read_text()
    addrs = [line.split('"')[1] for line in text.splitlines() if line.startswith("address")]
    keyring = keys.keyring(SECRET.encode())

    async def intrude(address: str, header: dict[str, object],
                      tensors: list[tuple[str, str, tuple[int, ...], bytes]],
                      identity: str = "127.0.0.5:4000") -> dict[str, object]:
        host, port = address.rsplit(":", 1)
        stream = await connect(host, int(port), keyring=keyring, identity=identity,
                               channel=1, local_addr=(identity.rsplit(":", 1)[0], 0))
        async with stream:
            await stream.send(encode_envelope(header, tensors))
            reply = parse_envelope(await asyncio.wait_for(stream.recv(), 10), p.ENGINE_SPECS)
            return reply.header

    attach = {"t": "attach", "model": model_identity(model), "cluster": "test-cluster"}
    served = asyncio.run(intrude(addrs[1], attach, []))
    assert served["t"] == "attached", served  # a router's command: any secret holder
    refused = asyncio.run(intrude(addrs[2], attach, [], identity=addrs[1]))
    assert refused["code"] == p.ERR_NOT_COORDINATOR and addrs[1] in str(refused["message"])
    hidden = ("hidden", "f32", (1, 1, 64), bytes(4 * 64))
    act = {"t": "act", "seq": "intruder", "step": 0, "sample": True}
    refused = asyncio.run(intrude(addrs[2], act, [hidden]))
    assert refused["code"] == p.ERR_NOT_UPSTREAM
    wait_for(lambda: stage_stats(pipe.stages[1]).get("refused") == 2, 5,
             "the refusals counted in the stage's stats")
    with client(pipe.url) as c:  # the pipeline still serves its coordinator
        text_out = c.completions.create(model="llama", prompt=PROMPT, max_tokens=6,
                                        temperature=0).choices[0].text
    assert text_out == expected(model, PROMPT, 6)


STATE = "mlxceld_stage_link_state"
RTT = "mlxceld_stage_link_rtt_seconds"


def ready(pipe: Pipeline) -> httpx.Response:
    return httpx.get(pipe.url.removesuffix("/v1") + "/ready", timeout=10)


def router_links(d: DaemonProc) -> list[dict[str, object]]:
    """The router worker's stages as the daemon's status shows them (its stats)."""
    stats = d.worker("router").get("stats") or {}
    links: list[dict[str, object]] = stats.get("stages", [])
    return links


def status_saying(d: DaemonProc, text: str) -> str | None:
    shown = d.ctl("status").stdout
    return shown if text in shown else None


@pytest.mark.slow
def test_ready_names_a_stopped_stage_and_recovers_without_a_request(
        llama: Shared, split_fixture_dir: Path) -> None:
    """The router attaches its stages at start and re-attaches one that comes back by
    itself: no completion is sent until /ready says 200 again. On the shared pipeline:
    the test itself brings stage-1 back, as its last step."""
    model = split_fixture_dir / "llama"
    pipe = llama.pipe
    wait_for(lambda: ready(pipe).status_code == 200, 30, "/ready 200 with both stages")
    shown = wait_for(lambda: status_saying(pipe.coordinator, "stages of router: 2 of 2 attached"),
                     10, "mlxctl status showing both stages attached")
    assert "stage-0" in shown and "stage-1" in shown
    # /metrics: each link's state, one gauge per state, and its heartbeat's round trip.
    up = wait_for(lambda: (m := scrape(pipe.url)) and all(
        sample(m, "mlxceld_stage_link_rtt_seconds", stage=f"stage-{r}", layers=ls)
        for r, ls in ((0, "0-2"), (1, "2-4"))) and m, 20, "both links' rtt in /metrics")
    for stage, layers in (("stage-0", "0-2"), ("stage-1", "2-4")):
        assert sample(up, STATE, stage=stage, layers=layers, state="attached") == 1
        assert sample(up, STATE, stage=stage, layers=layers, state="unreachable") == 0
        assert 0 < sample(up, RTT, stage=stage, layers=layers) < 3  # type: ignore[operator]

    stage = pipe.stages[1]
    assert stage.proc is not None
    stage.proc.send_signal(signal.SIGTERM)
    stage.proc.wait(30)
    try:
        down = wait_for(lambda: (r := ready(pipe)).status_code == 503 and r.json(), 10,
                        "/ready 503 once stage-1 is gone")
        assert down["status"] == "degraded" and "stage-1" in down["message"], down
        assert [s["stage"] for s in down["stages"]] == ["stage-1"]
        assert down["stages"][0]["state"] in ("disconnected", "unreachable")
        links = wait_for(lambda: (ls := router_links(pipe.coordinator)) and
                         ls[1]["state"] == "unreachable" and ls, 20,
                         "the router's stats showing stage-1 unreachable")
        assert links[0]["connected"] is True and links[1]["connected"] is False
        assert "stage-1" in str(links[1]["error"])
        shown = pipe.coordinator.ctl("status").stdout
        assert "stages of router: 1 of 2 attached" in shown and "unreachable" in shown, shown
        assert "worker router cannot reach stage stage-1 (unreachable)" in shown, shown
        down_metrics = scrape(pipe.url)
        assert sample(down_metrics, STATE, stage="stage-1", layers="2-4", state="unreachable") == 1
        assert sample(down_metrics, STATE, stage="stage-1", layers="2-4", state="attached") == 0
        assert sample(down_metrics, RTT, stage="stage-1", layers="2-4") is None
        assert sample(down_metrics, STATE, stage="stage-0", layers="0-2", state="attached") == 1
    finally:  # the test's next step, and the shared pipeline whole again if it failed
        bring_back(llama, 1)
    wait_for(lambda: ready(pipe).status_code == 200, 60,
             "/ready 200 again once stage-1 is back, with no request sent")
    wait_for(lambda: [s["connected"] for s in router_links(pipe.coordinator)] == [True, True],
             5, "the router's stats showing both stages attached again")
    with client(pipe.url) as c:
        text = c.completions.create(model="llama", prompt=PROMPT, max_tokens=6,
                                    temperature=0).choices[0].text
    assert text == expected(model, PROMPT, 6)
