"""Stage services and the pipeline engine in one process, over real MXCL on 127.0.0.x.

The stages load real fixture slices; the engine's greedy tokens must equal
mlx-lm's on the whole model. Authorization is checked with a second secret
holder dialing from another loopback address.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load

from mlxceld.daemon.roster import MODEL_STOP_TIMEOUT_S
from mlxceld.engine import EngineUnavailable, GenerationRequest, SamplingParams
from mlxceld.models import preset, write_fixture
from mlxceld.models.identity import model_identity
from mlxceld.models.slicing import load_stage
from mlxceld.net import connect, streams_under
from mlxceld.pipeline import PipelineEngine, sequences
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline import stage as stage_module
from mlxceld.pipeline import steps as steps_module
from mlxceld.roles.options import KVQuant
from mlxceld.wire import encode_envelope, parse_envelope
from mlxceld.wire.mx_tensors import to_blob
from mlxceld.wire.secret import key_id
from mlxceld.workers.runtime import progress_report

from helpers.keys import keyring
from helpers.models import quantized_greedy
from helpers.stages import COORD, SECRET, Cluster, cluster, reference, tokens_of
from helpers.waiting import until

PROMPT = [1, 5, 9, 200, 31, 7, 64, 3]


@pytest.mark.parametrize("family,splits", [
    ("llama", [(0, 2), (2, 4)]),
    ("qwen3", [(0, 1), (1, 3), (3, 4)]),
    ("llama", [(0, 3), (3, 4)]),
    ("llama", [(0, 4)]),  # one stage: it continues each sequence itself
])
def test_greedy_matches_mlx_lm(split_fixture_dir: Path, family: str,
                               splits: list[tuple[int, int]]) -> None:
    path = split_fixture_dir / family
    want = reference(path, PROMPT, 12)

    async def go() -> tuple[list[int], int]:
        async with cluster(path, splits) as c:
            engine = c.engine(path)
            try:
                return await tokens_of(engine, PROMPT, 12), engine.tokens
            finally:
                await engine.aclose()

    assert asyncio.run(go()) == (want, 12)  # and counted, for the router's tokens/s


def test_concurrent_sequences_and_long_prompt(split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "qwen3"
    long_prompt = [(i * 7) % 500 + 1 for i in range(p.PREFILL_CHUNK + 100)]  # two chunks
    prompts = [PROMPT, PROMPT[::-1], PROMPT[:3], long_prompt]
    wants = [reference(path, pr, 8) for pr in prompts]

    async def go() -> list[list[int]]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path)
            try:
                return list(await asyncio.gather(*(tokens_of(engine, pr, 8)
                                                   for pr in prompts)))
            finally:
                await engine.aclose()

    assert asyncio.run(go()) == wants


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_requests_under_load_get_what_each_gets_alone(
        bf16_split_fixture_dir: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """5 concurrent greedy requests of different prompt lengths (two prefill in chunks while
    the others decode) get the tokens each gets alone, which are mlx-lm's."""
    monkeypatch.setattr(p, "PREFILL_CHUNK", 32)
    path = bf16_split_fixture_dir / family
    prompts = [[(i * 37 + n * 11) % 500 + 1 for i in range(n)] for n in (3, 11, 26, 47, 90)]

    async def go() -> tuple[list[list[int]], list[list[int]]]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path)
            try:
                alone = [await tokens_of(engine, pr, 24) for pr in prompts]
                together = await asyncio.gather(*(tokens_of(engine, pr, 24)
                                                  for pr in prompts))
                return alone, list(together)
            finally:
                await engine.aclose()

    alone, together = asyncio.run(go())
    assert together == alone
    assert alone == [reference(path, pr, 24) for pr in prompts]


KV_PROMPTS = [PROMPT, [(i * 37 + 11) % 500 + 1 for i in range(40)],
              [3 + (i * 7) % 240 for i in range(p.PREFILL_CHUNK + 88)]]  # two chunks


@pytest.mark.parametrize("start", [0, 20])
def test_a_quantized_kv_cache_gives_mlx_lms_quantized_tokens(kv_fixture_dir: Path,
                                                             start: int) -> None:
    """``kv_quant`` (``[serve] kv_bits``) travels in each ``prepare`` and every stage
    quantizes its layers' caches: greedy tokens are mlx-lm's ``generate_step`` with the
    same kv_bits, group size and start (``helpers.models.quantized_greedy``), each prompt
    alone and (start 0: a batch is one kind) all at once, decode steps batched on the
    stages. With start 20 the prompt's last token is a step of its own, as mlx-lm's. At 4
    bits, where full precision gives other tokens for some of the prompts."""
    path = kv_fixture_dir / "qwen3"
    kv = KVQuant(4, 64, start)
    model, tokenizer = load(str(path))
    eos = set(tokenizer.eos_token_ids)
    n = 16

    async def go() -> tuple[list[list[int]], list[list[int]], int, int]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path, eos=eos, kv_quant=kv)
            try:
                alone = [await tokens_of(engine, pr, n) for pr in KV_PROMPTS]
                steps = c.services[1].stats.steps
                together = [] if start else list(await asyncio.gather(*(
                    tokens_of(engine, pr, n) for pr in KV_PROMPTS)))
                return alone, together, steps, c.services[1].stats.steps - steps
            finally:
                await engine.aclose()

    alone, together, alone_steps, together_steps = asyncio.run(go())
    for pr, got in zip(KV_PROMPTS, alone, strict=True):
        assert got == quantized_greedy(model, pr, n, kv, eos)[0], len(pr)
    assert alone != [quantized_greedy(model, pr, n, None, eos)[0] for pr in KV_PROMPTS]
    if not start:
        assert together == alone
        assert together_steps < alone_steps  # their decode steps were batched


def test_a_bad_kv_in_prepare_is_refused_by_name(kv_fixture_dir: Path) -> None:
    path = kv_fixture_dir / "llama"
    params = p.params_to_wire(SamplingParams(3, temperature=0))
    bad = [{"bits": 6, "group_size": 64, "start": 0}, {"bits": 8, "group_size": 16, "start": 0},
           {"bits": 8, "group_size": 64, "start": -1}, {"bits": 8, "group_size": 64},
           {"bits": 8.0, "group_size": 64, "start": 0}, [8, 64, 0]]

    async def go() -> list[dict[str, Any]]:
        async with cluster(path, [(0, 4)]) as c:
            st = c.stages[0]
            stream = await connect(st.host, st.port, keyring=c.ring, identity=COORD,
                                   channel=1, local_addr=("127.0.0.1", 0))
            answers = []
            async with stream:
                await stream.send(encode_envelope({"t": "attach", "cluster": "test",
                                                   "model": model_identity(path)}))
                await asyncio.wait_for(stream.recv(), 5)
                for i, kv in enumerate([*bad, p.kv_to_wire(KVQuant(4, 32, 7))]):
                    await stream.send(encode_envelope({"t": "prepare", "seq": f"k{i}",
                                                       "params": params, "kv": kv}))
                    answers.append(parse_envelope(await asyncio.wait_for(stream.recv(), 5),
                                                  p.ENGINE_SPECS).header)
            return answers

    *refused, prepared = asyncio.run(go())
    assert [a["code"] for a in refused] == [p.ERR_BAD_MESSAGE] * len(bad)
    assert [a["message"].split(" must")[0] for a in refused] == [
        "'kv.bits'", "'kv.group_size'", "'kv'", "'kv'", "'kv'", "'kv'"]
    assert prepared == {"t": "prepared", "seq": f"k{len(bad)}", "reused": 0}


def test_a_stage_whose_layers_cannot_be_quantized_refuses_kv(tmp_path: Path) -> None:
    """gemma3's window layers keep a RotatingKVCache: its stage refuses a ``prepare`` with
    ``kv``, naming the layer and the kind (its router refuses the family at start)."""
    write_fixture(tmp_path / "g", preset("tiny", family="gemma3_text", head_dim=64))
    model = load_stage(tmp_path / "g", 0, 2)
    with pytest.raises(p.ProtocolViolation) as err:
        sequences.stage_cache(model, KVQuant(8), "stage-0")
    assert err.value.code == p.ERR_BAD_MESSAGE
    assert err.value.message == ("'kv': stage stage-0 cannot keep a quantized KV cache: its "
                                 "layer 0 keeps a RotatingKVCache, which mlx-lm cannot "
                                 "quantize")
    assert len(sequences.stage_cache(model, None, "stage-0")) == 2


@pytest.mark.parametrize("splits", [[(0, 2), (2, 4)], [(0, 4)]])
def test_the_stages_stop_a_sequence_at_max_tokens_and_at_eos(split_fixture_dir: Path,
                                                             splits: list[tuple[int, int]]
                                                             ) -> None:
    """Decoding goes round the stages without the coordinator: they must stop by
    themselves, after exactly the tokens asked for (the last sampled one is never run)."""
    path = split_fixture_dir / "llama"
    want = reference(path, PROMPT, 6)

    async def go() -> tuple[list[int], int, list[int], int]:
        async with cluster(path, splits) as c:
            engine = c.engine(path)
            try:
                by_length = await tokens_of(engine, PROMPT, 6)
                await asyncio.sleep(0.3)  # anything still running would show by now
                after_length = c.services[0].stats.tokens
                eos_engine = c.engine(path, eos={want[3]})
                try:
                    by_eos = await tokens_of(eos_engine, PROMPT, 50)
                    await asyncio.sleep(0.3)
                    return (by_length, after_length, by_eos,
                            c.services[0].stats.tokens - after_length)
                finally:
                    await eos_engine.aclose()
            finally:
                await engine.aclose()

    by_length, ran_length, by_eos, ran_eos = asyncio.run(asyncio.wait_for(go(), 60))
    assert by_length == want
    assert ran_length == len(PROMPT) + 5
    stop = want.index(want[3])  # the first time the eos id comes up
    assert by_eos == want[:stop + 1]
    assert ran_eos == len(PROMPT) + stop


def test_a_one_stage_pipeline_serves_new_requests_while_a_long_one_decodes(
        split_fixture_dir: Path) -> None:
    """A one-stage pipeline feeds each sampled token back to itself, inline on its event
    loop's thread: it must still read what comes in between two steps (a new sequence's
    prepare, a cancel), not only once the running sequence has ended."""
    path = split_fixture_dir / "llama"
    want = reference(path, PROMPT[:3], 4)
    long_n = 600

    async def go() -> tuple[list[int], int]:
        async with cluster(path, [(0, 4)]) as c:
            engine = c.engine(path)
            try:
                long = engine.generate(GenerationRequest(
                    "long", PROMPT, SamplingParams(max_tokens=long_n, temperature=0.0)))
                await anext(long)
                short = await tokens_of(engine, PROMPT[:3], 4)
                steps = c.services[0].stats.steps  # the long one's, and the short one's
                await long.aclose()
                return short, steps
            finally:
                await engine.aclose()

    short, steps = asyncio.run(asyncio.wait_for(go(), 60))
    assert short == want
    assert steps < long_n // 2, steps  # answered while the long one had most to go


def test_wrong_model_is_refused_with_both_identities(split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"

    async def go() -> tuple[str, list[str]]:
        async with cluster(path, [(0, 2), (2, 4)], identity="f" * 64) as c:
            engine = c.engine(path)
            try:
                with pytest.raises(EngineUnavailable) as info:
                    await tokens_of(engine, PROMPT, 2)
                return str(info.value), [s["state"] for s in engine.stages()]
            finally:
                await engine.aclose()

    message, states = asyncio.run(go())
    assert "f" * 64 in message and model_identity(path) in message
    assert states == ["model_mismatch"] * 2


async def _intruder(c: Cluster, rank: int, messages: list[tuple[dict[str, Any], list[Any]]],
                    ip: str = "127.0.0.5", port: int = 4000) -> list[dict[str, Any]]:
    """Dial stage ``rank`` as another secret holder (``ip:port``); send ``messages``;
    collect answers."""
    st = c.stages[rank]
    stream = await connect(st.host, st.port, keyring=keyring(SECRET), identity=f"{ip}:{port}",
                           channel=1, local_addr=(ip, 0))
    answers = []
    async with stream:
        for header, tensors in messages:
            await stream.send(encode_envelope(header, tensors))
            if header["t"] in ("attach", "prepare", "run", "act", "next"):
                env = parse_envelope(await asyncio.wait_for(stream.recv(), 5),
                                     p.ENGINE_SPECS)
                answers.append(env.header)
    return answers


def test_commands_from_any_router_never_from_a_neighbour_acts_from_upstream_next_from_last(
        split_fixture_dir: Path) -> None:
    """Another secret holder (a second router) is served commands; the stage's upstream
    stage is not (it sends only activations); ``act`` and ``next`` only from their one
    stage; a sequence is its preparer's."""
    path = split_fixture_dir / "llama"

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]],
                            list[dict[str, Any]], int, list[int]]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            ident = model_identity(path)
            attach_prepare = [
                ({"t": "attach", "model": ident, "cluster": "test"}, []),
                ({"t": "prepare", "seq": "x1",
                  "params": p.params_to_wire(SamplingParams(3, temperature=0))}, [])]
            commands = await _intruder(c, 0, attach_prepare)  # a router: served
            upstream = c.stages[0]
            neighbour = await _intruder(c, 1, attach_prepare, ip=upstream.host,
                                        port=upstream.port)
            nexts = await _intruder(c, 0, [
                ({"t": "next", "seq": "x1", "step": 1},
                 [("tokens", "i32", (1, 1), (5).to_bytes(4, "little"))])])
            acts = await _intruder(c, 1, [
                ({"t": "act", "seq": "x1", "step": 0, "sample": True},
                 [to_blob("hidden", mx.zeros((1, 1, c.services[1]._model.hidden_size),
                                             dtype=c.services[1]._model.dtype))])])
            seqs = sum(s.sequences for s in c.services)  # each intruder's closed: freed
            engine = c.engine(path)
            try:  # the coordinator is still served
                after = await tokens_of(engine, PROMPT, 3)
            finally:
                await engine.aclose()
            return commands, neighbour, nexts, acts, seqs, after

    commands, neighbour, nexts, acts, seqs, after = asyncio.run(go())
    assert [a["t"] for a in commands] == ["attached", "prepared"], commands
    assert [a["code"] for a in neighbour] == [p.ERR_NOT_COORDINATOR] * 2
    assert "a stage of this pipeline" in neighbour[0]["message"]
    assert [a["code"] for a in acts] == [p.ERR_NOT_UPSTREAM]
    assert [a["code"] for a in nexts] == [p.ERR_NOT_LAST]
    assert "127.0.0.5:4000" in nexts[0]["message"]
    assert seqs == 0
    assert after == reference(path, PROMPT, 3)


def test_two_routers_drive_the_same_stages_at_once_each_owning_its_sequences(
        split_fixture_dir: Path) -> None:
    """A second router (another identity with the secret) and the coordinator generate on
    the same stages concurrently, each getting mlx-lm's tokens, each its prompt cache's
    hits (the entries kept apart by identity on the stages); a sequence nobody prepared
    is refused to a third."""
    path = split_fixture_dir / "llama"
    second = "127.0.0.6:19997"

    async def go() -> tuple[list[list[int]], list[int], int, list[dict[str, Any]]]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            one = c.engine(path)
            two = PipelineEngine(c.stages, keyring=c.ring, origin=second,
                                 model_identity=model_identity(path), cluster="test",
                                 model_id="m", context_length=4096, eos_token_ids=set())
            try:
                got = await asyncio.gather(*(tokens_of(e, PROMPT, 4)
                                             for e in (one, two, one, two)))
                async with asyncio.timeout(10):  # every stage said it keeps what was kept
                    while two.prompt_cache_stats()["pending"]:
                        await asyncio.sleep(0.05)
                again = await tokens_of(two, PROMPT, 4)  # from its own kept prefix
                hits = one.prompt_cache_stats()["hits"] + two.prompt_cache_stats()["hits"]
                stolen = await _intruder(c, 0, [
                    ({"t": "attach", "model": model_identity(path), "cluster": "test"}, []),
                    ({"t": "run", "seq": "nobody", "step": 0, "sample": True},
                     [("tokens", "i32", (1, 1), (5).to_bytes(4, "little"))])])
                return got, again, hits, stolen
            finally:
                await one.aclose()
                await two.aclose()

    got, again, hits, stolen = asyncio.run(asyncio.wait_for(go(), 120))
    want = reference(path, PROMPT, 4)
    assert got == [want] * 4 and again == want
    assert hits >= 1
    assert [a.get("code") for a in stolen][1:] == [p.ERR_UNKNOWN_SEQ]


def test_a_router_its_stages_refuse_is_told_so_by_node_never_by_address(
        split_fixture_dir: Path) -> None:
    """A router that dials with a neighbour stage's identity (the last stage's, to stage
    0): stage 0 refuses its attach naming addresses; the client's error and ``/ready``
    name the node."""
    path = split_fixture_dir / "llama"

    async def go() -> tuple[str, dict[str, Any] | None, list[dict[str, Any]], str]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            last = c.stages[-1]
            stranger = f"{last.host}:{last.port}"
            engine = PipelineEngine(c.stages, keyring=keyring(SECRET), origin=stranger,
                                    model_identity=model_identity(path), cluster="test",
                                    model_id="m", context_length=4096, eos_token_ids=set())
            try:
                with pytest.raises(EngineUnavailable) as info:
                    await tokens_of(engine, PROMPT, 2)
                return str(info.value), engine.readiness(), engine.stages(), stranger
            finally:
                await engine.aclose()

    message, ready, stats, stranger = asyncio.run(asyncio.wait_for(go(), 60))
    assert message.startswith("stage stage-0") and "refused to attach (not_coordinator)" \
        in message, message
    assert ready is not None and "refused to attach" in ready["message"]
    said = f"{message} {ready}"
    assert "127.0.0." not in said and COORD not in said and stranger not in said, said
    assert stats[0]["state"] == "refused", stats
    assert all(s["address"].startswith("127.0.0.") for s in stats)  # the operator's view


def test_a_stage_that_goes_away_fails_the_request_naming_it(split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"

    async def go() -> str:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path)
            try:
                await tokens_of(engine, PROMPT, 2)
                await c.listeners[1].aclose()  # drops every connection of stage 1
                with pytest.raises(EngineUnavailable) as info:
                    await tokens_of(engine, PROMPT, 4)
                return str(info.value)
            finally:
                await engine.aclose()

    message = asyncio.run(asyncio.wait_for(go(), 60))
    assert "stage-1" in message


def test_a_standby_stage_refuses_until_activated(split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"

    async def go() -> tuple[str, list[int]]:
        async with cluster(path, [(0, 2), (2, 4)], standby=True) as c:
            engine = c.engine(path)
            try:
                with pytest.raises(EngineUnavailable) as info:
                    await tokens_of(engine, PROMPT, 3)
                for svc in c.services:
                    svc.activate()
                return str(info.value), await tokens_of(engine, PROMPT, 3)
            finally:
                await engine.aclose()

    message, after = asyncio.run(go())
    assert "not active yet" in message
    assert after == reference(path, PROMPT, 3)


FAST = {"retry_s": (0.05, 0.2), "dial_budget_s": 0.3}  # background re-dials, quickly


def link_lines(caplog: pytest.LogCaptureFixture, stage: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "mlxceld.pipeline.links" and stage in r.getMessage()]


def test_links_are_kept_up_in_the_background_and_logged_once_per_change(
        split_fixture_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No request ever dials here: the engine attaches the stages itself, notices one go,
    retries it quietly while it is down, and attaches it again when it is back."""
    caplog.set_level(logging.DEBUG, logger="mlxceld.pipeline.links")
    path = split_fixture_dir / "llama"

    async def go() -> tuple[dict[str, Any], list[dict[str, Any]], list[tuple[int, str]],
                            list[int]]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path, **FAST)
            assert [s["state"] for s in engine.stages()] == ["connecting"] * 2
            assert engine.readiness() is not None
            linking = asyncio.ensure_future(engine.keep_linked())
            try:
                await until(lambda: engine.readiness() is None, "both stages attached", timeout=15)
                await until(lambda: all(s["rtt_ms"] for s in engine.stages()),
                            "a heartbeat's round trip timed on both links", timeout=15)
                await c.stop_stage(1)
                await until(lambda: engine.stages()[1]["failures"] >= 3,
                            "stage-1 failing again and again", timeout=15)
                problem = engine.readiness()
                assert problem is not None
                stages = engine.stages()
                down = link_lines(caplog, "stage-1")
                await c.restart_stage(1)
                await until(lambda: engine.readiness() is None, "stage-1 attached again",
                            timeout=15)
                down += link_lines(caplog, "stage-1")[len(down):]
                return problem, stages, down, await tokens_of(engine, PROMPT, 3)
            finally:
                linking.cancel()
                await engine.aclose()

    problem, stages, lines, after = asyncio.run(asyncio.wait_for(go(), 60))
    assert [s["stage"] for s in problem["stages"]] == ["stage-1"]
    assert problem["stages"][0]["state"] == "unreachable"
    assert problem["message"].startswith("1 of 2 stages not attached: stage-1 is unreachable")
    assert stages[0]["connected"] and stages[0]["state"] == "attached"
    assert stages[0]["error"] is None
    assert not stages[1]["connected"] and "stage-1" in stages[1]["error"]
    assert 0 < stages[0]["rtt_ms"] < 3000 and stages[1]["rtt_ms"] is None  # not attached
    # Once each: attached, lost, unreachable, attached again; the retries only at debug.
    changes = [(level, text) for level, text in lines if level > logging.DEBUG]
    assert [level for level, _ in changes] == [logging.INFO, logging.WARNING,
                                               logging.WARNING, logging.INFO], changes
    assert "is disconnected (was attached)" in changes[1][1]
    assert "is unreachable (was disconnected)" in changes[2][1]
    assert changes[3][1].endswith("(was unreachable)")
    assert sum(1 for level, _ in lines if level == logging.DEBUG) >= 2
    assert after == reference(path, PROMPT, 3)


def test_a_standby_stage_is_reported_as_such_until_activated(
        split_fixture_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mlxceld.pipeline.links")
    path = split_fixture_dir / "llama"

    async def go() -> tuple[list[dict[str, Any]], list[int]]:
        async with cluster(path, [(0, 2), (2, 4)], standby=True) as c:
            engine = c.engine(path, **FAST)
            linking = asyncio.ensure_future(engine.keep_linked())
            try:
                await until(lambda: all(
                    s["state"] == "standby" and s["failures"] >= 3 for s in engine.stages()),
                    "both stages refused as standby several times", timeout=15)
                standby = engine.stages()
                for svc in c.services:
                    svc.activate()
                await until(lambda: engine.readiness() is None, "both stages attached once active",
                            timeout=15)
                return standby, await tokens_of(engine, PROMPT, 3)
            finally:
                linking.cancel()
                await engine.aclose()

    standby, after = asyncio.run(asyncio.wait_for(go(), 60))
    assert all("is in standby" in s["error"] and "not active yet" in s["error"]
               for s in standby)
    for stage in ("stage-0", "stage-1"):
        changes = [(level, text) for level, text in link_lines(caplog, stage)
                   if level > logging.DEBUG]
        assert [level for level, _ in changes] == [logging.INFO, logging.INFO], changes
        assert "is in standby" in changes[0][1] and "(was standby)" in changes[1][1]
    assert after == reference(path, PROMPT, 3)


def test_a_request_dials_on_demand_rather_than_waiting_for_the_backoff(
        split_fixture_dir: Path) -> None:
    """The background waits 30 s between attempts here; a request while the stage is down
    fails within one attempt naming it, and one right after it is back succeeds."""
    path = split_fixture_dir / "llama"

    async def go() -> tuple[str, float, float, list[int]]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path, retry_s=(30.0, 30.0), dial_budget_s=0.3)
            linking = asyncio.ensure_future(engine.keep_linked())
            try:
                await until(lambda: engine.readiness() is None, "both stages attached", timeout=15)
                await until(lambda: all(s["rtt_ms"] for s in engine.stages()),
                            "a heartbeat's round trip timed on both links", timeout=15)
                await c.stop_stage(1)
                await until(lambda: engine.stages()[1]["state"] == "unreachable",
                            "stage-1 unreachable, the background asleep", timeout=15)
                loop = asyncio.get_running_loop()
                started = loop.time()
                with pytest.raises(EngineUnavailable) as info:
                    await tokens_of(engine, PROMPT, 2)
                failed_in = loop.time() - started
                await c.restart_stage(1)
                started = loop.time()
                tokens = await tokens_of(engine, PROMPT, 3)
                return str(info.value), failed_in, loop.time() - started, tokens
            finally:
                linking.cancel()
                await engine.aclose()

    message, failed_in, served_in, tokens = asyncio.run(asyncio.wait_for(go(), 60))
    # What the client reads names the node, never its address.
    assert message == ("stage stage-1 is unreachable: nothing accepts connections on its "
                       "port (tried for 0.3 s)")
    assert failed_in < 3.0
    assert served_in < 10.0 and tokens == reference(path, PROMPT, 3)


def test_token_ids_outside_the_vocabulary_fail_the_request_not_the_stage(
        split_fixture_dir: Path) -> None:
    path = split_fixture_dir / "llama"

    async def go() -> tuple[str, list[int]]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path)
            try:
                with pytest.raises(EngineUnavailable) as info:
                    await tokens_of(engine, [1, 5, 1 << 20], 2)
                return str(info.value), await tokens_of(engine, PROMPT, 3)
            finally:
                await engine.aclose()

    message, after = asyncio.run(asyncio.wait_for(go(), 60))
    assert "token ids must be in [0, " in message and f"..{1 << 20}" in message
    assert after == reference(path, PROMPT, 3)


@pytest.mark.parametrize("inline_below_s", [steps_module.INLINE_STEP_S, 0.0])
def test_short_decode_steps_run_inline_and_long_ones_on_the_compute_thread(
        split_fixture_dir: Path, monkeypatch: pytest.MonkeyPatch,
        inline_below_s: float) -> None:
    """Either way the tokens are mlx-lm's; with a bound of 0 no step is short enough, so
    every step runs on the compute thread with its layers overlapped."""
    monkeypatch.setattr(steps_module, "INLINE_STEP_S", inline_below_s)
    path = split_fixture_dir / "llama"
    long_prompt = [(i * 5) % 300 + 1 for i in range(p.PREFILL_CHUNK + 40)]  # two chunks

    async def go() -> tuple[list[list[int]], list[int], list[int]]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path)
            try:
                got = [await tokens_of(engine, PROMPT, 12),
                       await tokens_of(engine, long_prompt, 6)]
                return (got, [s.stats.inline for s in c.services],
                        [s.stats.steps for s in c.services])
            finally:
                await engine.aclose()

    got, inline, steps = asyncio.run(asyncio.wait_for(go(), 60))
    assert got == [reference(path, PROMPT, 12), reference(path, long_prompt, 6)]
    if inline_below_s:
        # The very first decode step runs on the compute thread (no decode step to
        # judge by yet; a prefill does not count); every later one inline.
        assert all(n >= 10 for n in inline), (inline, steps)
    else:
        assert inline == [0, 0]


def test_a_stage_reports_work_in_hand_and_its_steps_for_the_watchdog(
        split_fixture_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A last stage whose compute is held has work and no new step: what the supervisor's
    watchdog restarts (``types.WorkerProgress`` from ``workers.runtime.progress_report``);
    released, it steps, and with the sequence done it has no work left."""
    path = split_fixture_dir / "llama"
    gate = threading.Event()
    real = steps_module.run_group

    def held(model: Any, group: Any, *, overlap: bool = False) -> list[Any]:
        if model.last:
            gate.wait(30)
        return real(model, group, overlap=overlap)

    monkeypatch.setattr(steps_module, "run_group", held)

    async def go() -> list[int]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            first, last = c.services
            assert (first.busy_since, last.busy_since) == (None, None)
            engine = c.engine(path)
            try:
                task = asyncio.ensure_future(tokens_of(engine, PROMPT, 3))
                await until(lambda: last.busy_since is not None, "the last stage has work")
                await asyncio.sleep(0.3)
                held_for = progress_report(last.stats.steps, last.stats.last_step_at,
                                           last.busy_since)
                assert held_for["busy"] and held_for["steps"] == 0
                assert held_for["last_step_at"] is None and held_for["stalled_s"] >= 0.3
                assert first.busy_since is None and first.stats.steps == 1  # passed it on
                gate.set()
                got = await asyncio.wait_for(task, 30)
                await until(lambda: last.busy_since is None, "the last stage is done")
                done = progress_report(last.stats.steps, last.stats.last_step_at, None)
                assert done["steps"] == 3 and not done["busy"] and done["stalled_s"] == 0
                assert done["last_step_at"] is not None
                return got
            finally:
                gate.set()
                await engine.aclose()

    assert asyncio.run(asyncio.wait_for(go(), 60)) == reference(path, PROMPT, 3)


def test_a_draining_stage_finishes_its_sequences_and_refuses_new_ones(
        split_fixture_dir: Path) -> None:
    """``StageService.drain`` (a stopping stage worker): a sequence in flight runs to its
    end; a new request is refused, naming the stage by node id, with Retry-After; the
    drain ends as soon as nothing is held, and at its deadline otherwise."""
    path = split_fixture_dir / "llama"
    n = 40
    assert stage_module.DRAIN_S < MODEL_STOP_TIMEOUT_S  # the supervisor never cuts it short

    async def go() -> tuple[list[int], EngineUnavailable, int, int, float]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:
            engine = c.engine(path)
            try:
                req = GenerationRequest("r", PROMPT, SamplingParams(max_tokens=n,
                                                                    temperature=0.0))
                outs = engine.generate(req)
                got = [(await anext(outs)).token]  # in flight on both stages
                loop = asyncio.get_running_loop()
                drain = asyncio.ensure_future(c.services[1].finish_held(loop.time() + 30))
                await until(lambda: c.services[1].draining, "the stage drains")
                with pytest.raises(EngineUnavailable) as refused:
                    await tokens_of(engine, PROMPT, 2)
                got += [t.token async for t in outs]
                left = await asyncio.wait_for(drain, 10)  # released: the drain ends
                # A sequence nobody releases is held until the deadline, then dropped.
                c.services[1].draining = False
                held = engine.generate(req)
                await anext(held)
                start = loop.time()
                dropped = await c.services[1].finish_held(start + 0.5)
                took = loop.time() - start
                await held.aclose()
                return got, refused.value, left, dropped, took
            finally:
                await engine.aclose()

    got, refused, left, dropped, took = asyncio.run(asyncio.wait_for(go(), 60))
    assert got == reference(path, PROMPT, n)
    assert "stage stage-1 is draining" in str(refused) and "127.0.0" not in str(refused)
    assert refused.retry_after_s == 5
    assert left == 0
    assert dropped == 1 and 0.4 <= took < 5


def test_sequences_move_to_the_new_primary_key_mid_decode(split_fixture_dir: Path) -> None:
    """The keyring's primary changes while 3 sequences decode (a rotation's ``use``): the
    engine's links and the stages' streams hand over to the new key, the sequences move
    over (``adopt``) with every token in order, and no stream is left under the old key
    although none of the sequences ended (links.py, redialer.py)."""
    path = split_fixture_dir / "llama"
    n = 100
    want = reference(path, PROMPT, n)
    new = b"pipeline-test-secret-new-abcdefgh"
    ring = keyring(SECRET, new)

    async def go() -> list[list[int]]:
        async with cluster(path, [(0, 2), (2, 4)], ring=ring) as c:
            engine = c.engine(path)
            linking = asyncio.ensure_future(engine.keep_linked())  # as the router runs it
            try:
                requests = [engine.generate(GenerationRequest(
                    f"r{i}", PROMPT, SamplingParams(max_tokens=n, temperature=0.0)))
                    for i in range(3)]
                got = [[(await anext(r)).token] for r in requests]  # each one decodes
                ring.replace_all(new, [SECRET])
                engine.rekey()
                for svc in c.services:
                    svc.rekey()
                await until(lambda: streams_under(key_id(SECRET)) == 0,
                            "no stream left under the old key", timeout=10)
                assert engine.active_sequences() == 3  # moved, not ended
                for tokens, r in zip(got, requests, strict=True):
                    tokens.extend([t.token async for t in r])
                assert await tokens_of(engine, PROMPT, 4) == want[:4]  # a new one, new key
                return got
            finally:
                linking.cancel()
                await engine.aclose()

    assert asyncio.run(go()) == [want] * 3


def test_a_handover_the_stages_refuse_keeps_the_old_stream_and_warns_once(
        split_fixture_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The engine's primary changes to a key the stages do not hold (a `mlxctl secret use`
    on the router's host only): each link stays on its stream under the old key, requests
    go on being served, and the refused handover is warned about once per link, not at
    every retry."""
    path = split_fixture_dir / "llama"
    want = reference(path, PROMPT, 4)
    new = b"pipeline-test-secret-new-abcdefgh"
    ours = keyring(SECRET, new)

    async def go() -> list[int]:
        async with cluster(path, [(0, 2), (2, 4)]) as c:  # the stages hold SECRET only
            engine = PipelineEngine(c.stages, keyring=ours, origin=COORD,
                                    model_identity=model_identity(path), cluster="test",
                                    model_id="m", context_length=4096, eos_token_ids=set(),
                                    retry_s=(0.05, 0.1))
            linking = asyncio.ensure_future(engine.keep_linked())
            try:
                assert await tokens_of(engine, PROMPT, 4) == want
                ours.replace_all(new, [SECRET])
                engine.rekey()
                await asyncio.sleep(1.0)  # about ten refused handovers per link
                return await tokens_of(engine, PROMPT, 4)
            finally:
                linking.cancel()
                await engine.aclose()

    with caplog.at_level(logging.DEBUG, logger="mlxceld.pipeline.links"):
        assert asyncio.run(go()) == want
    tries = [r for r in caplog.records if "stays on key" in r.getMessage()]
    assert [r.levelno for r in tries].count(logging.WARNING) == 2, tries  # once per link
    assert len(tries) > 4  # it kept trying
