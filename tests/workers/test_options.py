"""Each role's options: JSON out and back unchanged, a bad field refused by name, once, on
entry; a real worker handed bad options exits EXIT_CONFIG, naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mlxceld.errors import ConfigError
from mlxceld.roles import WORKER_ROLES
from mlxceld.roles.options import (
    EXIT_CONFIG,
    OPTIONS,
    EchoOptions,
    PipelineOptions,
    PipelineStage,
    ReplicasOptions,
    RouterOptions,
    StageOptions,
    WorkerOptions,
    options_json,
    parse_options,
)
from mlxceld.supervisor.exits import read_exit_record
from mlxceld.supervisor.process import WorkerSpec, child_environment

PIPELINE = PipelineOptions(
    stages=(PipelineStage("stage-0", "127.0.0.2:19100", 0, (0, 2)),
            PipelineStage("stage-1", "[::1]:19101", 1, (2, 4))),
    coordinator="127.0.0.1:19000", model_identity="ab" * 32, cluster="c1")
REPLICAS = ReplicasOptions(agents=("studio-2.local:19000", "[fd00::13]:19001"),
                           origin="0.0.0.0:19000", cluster="c1")
ROUTER = RouterOptions(model="/models/tiny", model_name="tiny", host="127.0.0.1", port=8080,
                       max_batch=8, max_queued=64)
STAGE = StageOptions(model="/models/tiny", layers=(2, 4), node_id="stage-1", rank=1,
                     address="127.0.0.3:19101", coordinator="127.0.0.1:19000",
                     upstream="127.0.0.2:19100", downstream=None, first="127.0.0.2:19100",
                     last=None, model_identity="ab" * 32, cluster="c1", standby=True)


def test_every_role_has_its_options() -> None:
    assert set(OPTIONS) == set(WORKER_ROLES)


@pytest.mark.parametrize("options", [
    EchoOptions(), EchoOptions(interval_s=0.2, crash_after_s=1, exit_code=3, ignore_term=True),
    ROUTER, replace(ROUTER, pipeline=PIPELINE), STAGE, replace(ROUTER, replicas=REPLICAS),
], ids=["echo", "echo-all", "router", "router-pipeline", "stage", "router-replicas"])
def test_options_cross_as_json_and_come_back_equal(options: WorkerOptions) -> None:
    wire = json.loads(json.dumps(options_json(options)))  # as the bootstrap pipe carries it
    back = parse_options(options.role, wire)
    assert back == options and type(back) is type(options)


def test_the_json_is_plain() -> None:
    wire = options_json(replace(ROUTER, pipeline=PIPELINE))
    pipeline = wire["pipeline"]
    assert isinstance(pipeline, dict)
    assert pipeline["stages"][1] == {"node_id": "stage-1", "address": "[::1]:19101",
                                     "rank": 1, "layers": [2, 4]}
    assert wire["port"] == 8080 and options_json(STAGE)["downstream"] is None


def refused(role: str, raw: object) -> str:
    with pytest.raises(ConfigError) as info:
        parse_options(role, raw)
    assert info.value.hint
    return info.value.message


def stage(**change: Any) -> dict[str, Any]:
    return {**json.loads(json.dumps(options_json(STAGE))), **change}


@pytest.mark.parametrize(("raw", "said"), [
    (stage(layers=[2]), "option 'options.layers' must be a list of 2, not [2]"),
    (stage(layers=[4, 2]), "option 'options.layers' must be [start, end) with 0 <= start < end, "
                           "not (4, 2)"),
    (stage(layers=["2", 4]), "option 'options.layers[0]' must be an integer, not '2'"),
    (stage(rank=True), "option 'options.rank' must be an integer, not True"),
    (stage(rank=-1), "option 'options.rank' must be >= 0, not -1"),
    (stage(downstream="127.0.0.4"), "option 'options.downstream' must be host:port "
                                    "(it has no ':port'), not '127.0.0.4'"),
    (stage(upstream=""), "option 'options.upstream' must be a non-empty string, not ''"),
    (stage(standby="yes"), "option 'options.standby' must be true or false, not 'yes'"),
    (stage(colour="blue"), "unknown option 'options.colour'"),
    ({k: v for k, v in stage().items() if k != "cluster"}, "option 'options.cluster' is "
                                                           "missing"),
    ([1, 2], "'options' must be a table of options, not [1, 2]"),
])
def test_a_bad_stage_option_is_named(raw: object, said: str) -> None:
    assert refused("stage", raw) == said


def test_a_router_over_replicas_and_a_pipeline_at_once_is_refused() -> None:
    raw = options_json(replace(ROUTER, replicas=REPLICAS))
    raw["pipeline"] = options_json(PIPELINE)
    with pytest.raises(ConfigError, match=r"option 'options\.replicas' must be null with a "
                       "pipeline"):
        parse_options("router", raw)
    with pytest.raises(ConfigError, match=r"option 'options\.replicas\.agents' must name at "
                       "least one replica"):
        parse_options("router", {**options_json(ROUTER), "replicas": {
            "agents": [], "origin": "0.0.0.0:19000", "cluster": "c1"}})


def test_a_bad_pipeline_stage_is_named_by_its_path() -> None:
    raw = json.loads(json.dumps(options_json(replace(ROUTER, pipeline=PIPELINE))))
    raw["pipeline"]["stages"][1]["layers"] = [2, "4"]
    assert refused("router", raw) == ("option 'options.pipeline.stages[1].layers[1]' must be "
                                      "an integer, not '4'")
    raw["pipeline"]["stages"][1]["layers"] = [2, 4]
    raw["pipeline"]["stages"][1]["rank"] = 5
    assert refused("router", raw) == ("option 'options.pipeline.stages' must be in rank "
                                      "order 0, 1, ..., not [0, 5]")
    raw["pipeline"] = None
    assert parse_options("router", raw) == ROUTER  # no pipeline: the model runs locally


def test_an_unknown_role_is_refused() -> None:
    assert refused("hybrid", {}) == "no worker role 'hybrid'"


def test_defaults_fill_in_and_numbers_widen() -> None:
    assert parse_options("echo", {"interval_s": 1}) == EchoOptions(interval_s=1.0)
    assert parse_options("echo", {}) == EchoOptions()


# -- a real worker, handed bad options on its bootstrap pipe ----------------------------------


def test_a_worker_refuses_bad_options_before_its_role_runs(state_dir: Path) -> None:
    spec = WorkerSpec("w1", state_dir, EchoOptions())
    boot = spec.bootstrap()
    boot["options"] = {"interval_s": "soon"}  # what no daemon of ours writes
    for d in (spec.control_socket.parent, spec.log_path.parent):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "mlxceld.workers", "--role", "echo",
                             "--name", "w1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=child_environment(), cwd=state_dir)
    out, _ = proc.communicate(json.dumps(boot).encode(), timeout=30)
    assert proc.returncode == EXIT_CONFIG
    said = "option 'options.interval_s' must be a number, not 'soon'"
    assert said in out.decode()
    assert "Traceback" not in out.decode()  # a refusal, not a crash
    cause = read_exit_record(spec.exit_record, proc.pid)
    assert cause is not None and (cause.kind, cause.returncode) == ("config", EXIT_CONFIG)
    assert said in cause.summary
    assert not spec.control_socket.exists()  # it never got as far as its channel


TP_RING = ["127.0.0.1:29500", "127.0.0.1:29501"]


@pytest.mark.parametrize(("raw", "named"), [
    ({"rank": 0}, "option 'options.rank' must be in 1-1 (rank 0 is the router)"),
    ({"rank": 2}, "option 'options.rank' must be in 1-1"),
    ({"tp_hosts": TP_RING[:1]}, "option 'options.tp_hosts' must name 2-16 ranks' host:port"),
    ({"tp_hosts": [TP_RING[0]] * 2}, "option 'options.tp_hosts' must name each host:port once"),
    ({"tp_hosts": ["127.0.0.1", TP_RING[1]]}, "option 'options.tp_hosts' must be host:port"),
    ({"max_batch": 0}, "option 'options.max_batch' must be >= 1"),
])
def test_a_tp_ranks_options_are_checked_naming_the_field(raw: dict[str, Any],
                                                         named: str) -> None:
    good = {"model": "/m", "model_name": "m", "rank": 1, "tp_hosts": TP_RING, "max_batch": 4}
    parse_options("tp", good)
    with pytest.raises(ConfigError) as err:
        parse_options("tp", {**good, **raw})
    assert err.value.message.startswith(named), err.value.message


def test_a_routers_ring_names_one_address_per_rank_and_none_without_tp() -> None:
    base = {"model": "/m", "model_name": "m", "host": "127.0.0.1", "port": 8080,
            "max_batch": 4, "max_queued": 8}
    assert parse_options("router", {**base, "tp_size": 2, "tp_hosts": TP_RING})
    for raw, named in (({"tp_size": 3, "tp_hosts": TP_RING}, "options.tp_hosts' must name "
                        "one host:port per rank (3)"),
                       ({"tp_hosts": TP_RING}, "options.tp_hosts' must be empty with "
                        "tp_size 1"),
                       ({"tp_size": 17}, "options.tp_size' must be in 1-16")):
        with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
            parse_options("router", {**base, **raw})


def test_the_tp_size_bound_is_the_tensor_checks() -> None:
    from mlxceld.models import tensor
    from mlxceld.roles import options

    assert options.MAX_TP_SIZE == tensor.MAX_TP_SIZE
