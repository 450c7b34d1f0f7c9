"""Which workers a daemon runs, as a pure function of its config and state: each case."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mlxceld.cluster.clusterfile.load import parse_cluster_text
from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.config.daemon import Config, WorkerConfig
from mlxceld.config.serve import ServeConfig
from mlxceld.daemon.roster import (
    MODEL_START_TIMEOUT_S,
    MODEL_STOP_TIMEOUT_S,
    Situation,
    draw_roster,
)
from mlxceld.roles.options import EchoOptions, RouterOptions, StageOptions
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.supervisor.states import RestartPolicy

STATE = Path("/nonexistent/mlxceld")  # never touched: the roster does no IO
SECRET = b"s" * 32
KEY = "sk-test-0123456789"
MODEL = "/models/tiny"
IDENTITY = "ab" * 32
POLICY = RestartPolicy(backoff_initial_s=0.5, start_timeout_s=5.0, stop_timeout_s=2.0)
CLUSTER = parse_cluster_text("""
[cluster]
name = "lab"
pipeline_parallel_size = 2

[[nodes]]
id = "coordinator"
address = "127.0.0.1:19000"
role = "coordinator"

[[nodes]]
id = "stage-0"
address = "127.0.0.2:19100"
role = "pipeline_stage"
rank = 0
layers = [0, 2]

[[nodes]]
id = "stage-1"
address = "127.0.0.3:19101"
role = "pipeline_stage"
rank = 1
layers = [2, 4]
""", Path("cluster-1.toml"))


def placed(node_id: str) -> Placement:
    node = next(n for n in CLUSTER.nodes if n.id == node_id)
    return Placement(CLUSTER, node, Path(MODEL), IDENTITY)


def situation(*, config: Config | None = None, model: str | None = MODEL,
              placement: Placement | None = None, standby: bool = False,
              hold_router: bool = False) -> Situation:
    c = config or Config(state_dir=STATE, socket=STATE / "s.sock", policy=POLICY)
    return Situation(c, ServeConfig(model=model), placement, standby=standby,
                     hold_router=hold_router, secret=SECRET, api_key=KEY)


def only(specs: list[WorkerSpec]) -> WorkerSpec:
    assert len(specs) == 1, specs
    return specs[0]


def test_nothing_configured_runs_nothing() -> None:
    assert draw_roster(situation(model=None)) == []


def test_a_single_host_serves_its_model_with_the_api_key_and_no_secret() -> None:
    spec = only(draw_roster(situation()))
    assert (spec.name, spec.role, spec.state_dir) == ("router", "router", STATE)
    assert spec.options == RouterOptions(model=MODEL, model_name="tiny", host="127.0.0.1",
                                         port=8080, max_batch=8, max_queued=64)
    assert spec.api_key == KEY and spec.secret is None  # a single host needs no secret
    # A model loads slowly and drains its streams: [supervisor]'s policy, widened.
    assert spec.policy == RestartPolicy(backoff_initial_s=0.5,
                                        start_timeout_s=MODEL_START_TIMEOUT_S,
                                        stop_timeout_s=MODEL_STOP_TIMEOUT_S)


def test_configured_workers_come_first_with_their_own_policy() -> None:
    echo = WorkerConfig("ticker", EchoOptions(interval_s=0.2), RestartPolicy(flap_max_exits=2))
    config = Config(state_dir=STATE, socket=STATE / "s.sock", policy=POLICY, workers=(echo,))
    first, router = draw_roster(situation(config=config))
    assert first == WorkerSpec("ticker", STATE, EchoOptions(interval_s=0.2),
                               RestartPolicy(flap_max_exits=2))
    assert first.secret is None and first.api_key is None
    assert router.name == "router"
    assert [s.name for s in draw_roster(situation(config=config, model=None))] == ["ticker"]


@pytest.mark.parametrize("standby", [False, True])
def test_a_stage_node_runs_its_stage_with_the_secret_and_no_router(standby: bool) -> None:
    config = Config(state_dir=STATE, socket=STATE / "s.sock", policy=POLICY, pp_peer=True)
    spec = only(draw_roster(situation(config=config, placement=placed("stage-1"),
                                      standby=standby)))
    assert (spec.name, spec.role, spec.secret, spec.api_key) == ("stage", "stage", SECRET,
                                                                 None)
    assert spec.options == StageOptions(
        model=MODEL, layers=(2, 4), node_id="stage-1", rank=1, address="127.0.0.3:19101",
        coordinator="127.0.0.1:19000", upstream="127.0.0.2:19100", downstream=None,
        first="127.0.0.2:19100", last=None, model_identity=IDENTITY, cluster="lab",
        standby=standby)
    assert spec.policy.start_timeout_s == MODEL_START_TIMEOUT_S


def test_the_stage_silence_bound_of_serve_reaches_the_stage_and_the_router() -> None:
    from dataclasses import replace

    for node, attribute in (("stage-1", "silence_s"), ("coordinator", "stage_silence_s")):
        s = situation(placement=placed(node))
        s = replace(s, serve=replace(s.serve, stage_silence_s=1.25))
        assert getattr(only(draw_roster(s)).options, attribute) == 1.25


def test_a_stage_node_of_a_written_cluster_runs_its_stage_too() -> None:
    spec = only(draw_roster(situation(placement=placed("stage-0"))))  # no pp_peer
    assert isinstance(spec.options, StageOptions) and spec.options.last == "127.0.0.3:19101"


def test_a_coordinator_serves_the_pipeline_with_the_secret_even_while_holding() -> None:
    for hold in (False, True):  # a pushed plan's router runs though pp_auto held it back
        spec = only(draw_roster(situation(placement=placed("coordinator"),
                                          hold_router=hold)))
        assert spec.name == "router" and spec.secret == SECRET and spec.api_key == KEY
        assert isinstance(spec.options, RouterOptions)
        pipe = spec.options.pipeline
        assert pipe is not None and pipe.coordinator == "127.0.0.1:19000"
        assert [(s.node_id, s.address, s.rank, s.layers) for s in pipe.stages] == [
            ("stage-0", "127.0.0.2:19100", 0, (0, 2)),
            ("stage-1", "127.0.0.3:19101", 1, (2, 4))]
        assert (pipe.model_identity, pipe.cluster) == (IDENTITY, "lab")


def test_no_single_host_router_while_held_back() -> None:
    """pp_auto waiting for its plan, a plan to resume, or after a deactivation."""
    config = Config(state_dir=STATE, socket=STATE / "s.sock", policy=POLICY, pp_auto=2)
    assert draw_roster(situation(config=config, hold_router=True)) == []
    assert only(draw_roster(situation(config=config, hold_router=False))).name == "router"


def test_a_peer_without_a_stage_runs_no_router() -> None:
    config = Config(state_dir=STATE, socket=STATE / "s.sock", policy=POLICY, pp_peer=True)
    assert draw_roster(situation(config=config)) == []


def test_the_same_situation_gives_the_same_roster() -> None:
    s = situation(placement=placed("coordinator"))
    assert draw_roster(s) == draw_roster(s)
    assert not STATE.exists()




@pytest.mark.parametrize("agent_addr", ["0.0.0.0:19000", "127.0.0.1:0"])
def test_a_keyed_router_serves_on_the_agent_host_even_with_an_ephemeral_agent_port(
        agent_addr: str) -> None:
    """An agent listener on port 0 (the system picks one) is a valid agent address; the
    serving listener takes its host. Before, such a daemon crashed drawing its roster."""
    c = Config(state_dir=STATE, socket=STATE / "s.sock", policy=POLICY, agent_addr=agent_addr)
    s = dataclasses.replace(situation(config=c), node_id="node-a")
    spec = only(draw_roster(s))
    assert isinstance(spec.options, RouterOptions) and spec.options.serving is not None
    host = agent_addr.rsplit(":", 1)[0]
    assert spec.options.serving.address == f"{host}:0"
    assert spec.secret == SECRET
def test_a_router_node_runs_its_router_over_the_replicas_once_its_agent_is_bound() -> None:
    from dataclasses import replace

    from mlxceld.roles.options import ReplicasOptions

    s = situation()
    s = replace(s, serve=replace(s.serve, node_role="router",
                                 replicas=("10.0.0.2:19000", "mac-3:19000")))
    assert draw_roster(s) == []  # its identity is its agent's address: not bound yet
    spec = only(draw_roster(replace(s, agent_address="0.0.0.0:19000")))
    assert spec.name == "router" and spec.secret == SECRET and spec.api_key == KEY
    assert isinstance(spec.options, RouterOptions) and spec.options.pipeline is None
    assert spec.options.replicas == ReplicasOptions(
        agents=("10.0.0.2:19000", "mac-3:19000"), origin="0.0.0.0:19000",
        cluster="mlxcel-cluster")
    assert draw_roster(replace(s, agent_address="0.0.0.0:19000", serve=replace(
        s.serve, model=None))) == []  # no model: no tokenizer to serve with


def test_a_router_in_front_of_a_pipeline_runs_over_the_plan_it_follows_only() -> None:
    """``[serve] pipeline_coordinator``: no router before a plan is learnt; then one over
    that plan's stages, with the secret and the API key (daemon/following.py)."""
    from dataclasses import replace

    from mlxceld.cluster.clusterfile.placement import pipeline_options

    s = situation()
    s = replace(s, agent_address="127.0.0.5:19000", serve=replace(
        s.serve, node_role="router", pipeline_coordinator="127.0.0.1:19000"))
    assert draw_roster(s) == []  # nothing learnt from the coordinator yet
    followed = replace(pipeline_options(placed("coordinator")), coordinator="127.0.0.5:19000")
    spec = only(draw_roster(replace(s, followed=followed)))
    assert spec.name == "router" and spec.secret == SECRET and spec.api_key == KEY
    assert isinstance(spec.options, RouterOptions) and spec.options.pipeline == followed
    assert spec.options.replicas is None
    assert draw_roster(replace(s, followed=followed, serve=replace(s.serve, model=None))) == []


RING = ("127.0.0.1:29500", "127.0.0.1:29501", "127.0.0.1:29502")


def tensor(s: Situation, tp_size: int = 3) -> Situation:
    return dataclasses.replace(s, serve=dataclasses.replace(s.serve, tp_size=tp_size),
                               tp_hosts=RING[:tp_size])


def test_tp_size_runs_the_router_as_rank_0_and_a_tp_worker_per_other_rank() -> None:
    from mlxceld.roles.options import TensorOptions

    specs = draw_roster(tensor(situation()))
    assert [s.name for s in specs] == ["router", "tp-1", "tp-2"]
    assert {s.group for s in specs} == {"tp"}
    router, *ranks = specs
    assert isinstance(router.options, RouterOptions)
    assert (router.options.tp_size, router.options.tp_hosts) == (3, RING)
    assert router.api_key == KEY  # the OpenAI port stays the router's
    for rank, spec in enumerate(ranks, start=1):
        assert spec.options == TensorOptions(model=MODEL, model_name="tiny", rank=rank,
                                             tp_hosts=RING, max_batch=8)
        assert spec.role == "tp" and spec.secret is None and spec.api_key is None
        assert spec.policy == router.policy  # the model's: a rank loads its slice too
    # tp_size 1: the router alone, as before.
    assert only(draw_roster(tensor(situation(), 1))).group is None


def test_a_hybrid_replicas_router_keeps_its_serving_listener_and_its_ranks_no_secret() -> None:
    s = dataclasses.replace(tensor(situation(), 2), node_id="node-a")
    router, rank = draw_roster(s)
    assert isinstance(router.options, RouterOptions) and router.options.serving is not None
    assert router.secret == SECRET and router.group == "tp"
    assert rank.name == "tp-1" and rank.secret is None and rank.accepted == ()


def test_tp_size_adds_no_rank_where_no_router_runs_the_model_here() -> None:
    assert draw_roster(tensor(situation(hold_router=True))) == []
    assert draw_roster(tensor(situation(model=None))) == []
    # A pipeline's coordinator holds no layers (tp_size refused there at startup).
    coordinator = only(draw_roster(tensor(situation(placement=placed("coordinator")))))
    assert coordinator.group is None


def test_a_ring_without_ports_runs_the_router_alone_to_refuse_it() -> None:
    s = dataclasses.replace(tensor(situation(), 2), tp_hosts=())  # none could be bound
    router = only(draw_roster(s))
    assert isinstance(router.options, RouterOptions) and router.options.tp_hosts == ()


def test_a_stage_host_with_tp_size_runs_its_stage_as_rank_0_of_a_group_of_its_own() -> None:
    from mlxceld.roles.options import StageTensorOptions

    for standby in (True, False):
        specs = draw_roster(tensor(situation(placement=placed("stage-1"), standby=standby)))
        assert [s.name for s in specs] == ["stage", "stage-tp-1", "stage-tp-2"]
        assert {s.group for s in specs} == {"stage-tp"}
        stage, *ranks = specs
        assert isinstance(stage.options, StageOptions)
        assert (stage.options.tp_size, stage.options.tp_hosts) == (3, RING)
        assert stage.options.standby == standby and stage.secret == SECRET
        for rank, spec in enumerate(ranks, start=1):
            assert spec.options == StageTensorOptions(model=MODEL, layers=(2, 4),
                                                      node_id="stage-1", rank=rank,
                                                      tp_hosts=RING)
            assert spec.role == "stage_tp" and spec.secret is None and spec.api_key is None
            assert spec.policy == stage.policy
    # No ring (no port could be bound): the stage alone, which refuses it by name.
    s = dataclasses.replace(tensor(situation(placement=placed("stage-1")), 2), tp_hosts=())
    stage = only(draw_roster(s))
    assert isinstance(stage.options, StageOptions)
    assert (stage.options.tp_size, stage.options.tp_hosts) == (2, ())


def test_a_stage_host_whose_group_spans_hosts_runs_its_stage_alone_once_formed() -> None:
    """``--pp-peer --tp-size 2 --tp-peers``: no stage worker until the ring is formed
    (daemon/stage_peers.py), then the stage alone as rank 0 (its ranks are the rank
    hosts'), in no local group."""
    s = tensor(situation(placement=placed("stage-1")), 2)
    s = dataclasses.replace(s, serve=dataclasses.replace(s.serve, tp_peers=("10.0.0.9:19000",)),
                            tp_hosts=())
    assert draw_roster(s) == []
    ring = ("10.0.0.2:40000", "10.0.0.9:40001")
    stage = only(draw_roster(dataclasses.replace(s, tp_hosts=ring)))
    assert stage.name == "stage" and stage.group is None
    assert isinstance(stage.options, StageOptions)
    assert (stage.options.tp_size, stage.options.tp_hosts) == (2, ring)


def test_a_rank_host_asked_for_a_stage_runs_its_stage_tp_worker() -> None:
    from mlxceld.roles.options import StageTensorOptions, TensorOptions

    ring = ("10.0.0.2:40000", "10.0.0.9:40001")
    s = situation()
    s = dataclasses.replace(s, serve=dataclasses.replace(s.serve,
                                                         node_role="tensor_parallel_rank"))
    assert draw_roster(s) == []  # not asked yet
    staged = StageTensorOptions(model=MODEL, layers=(2, 4), node_id="stage-1", rank=1,
                                tp_hosts=ring)
    spec = only(draw_roster(dataclasses.replace(s, tensor_rank=staged)))
    assert (spec.name, spec.role, spec.options, spec.secret) == ("stage-tp-1", "stage_tp",
                                                                 staged, None)
    whole = TensorOptions(model=MODEL, model_name=None, rank=1, tp_hosts=ring, max_batch=8)
    assert only(draw_roster(dataclasses.replace(s, tensor_rank=whole))).name == "tp-1"
