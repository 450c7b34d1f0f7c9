"""The router worker's engine mode, read once off its options (``workers/modes.py``):
each field of the bootstrap's ``RouterOptions`` that names where the engine is gives one
mode, and tensor parallelism where it is not built is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from mlxceld.errors import ConfigError
from mlxceld.roles.options import (
    HandoffOptions,
    PipelineOptions,
    PipelineStage,
    ReplicasOptions,
    RouterOptions,
    ServingOptions,
)
from mlxceld.workers.modes import (
    DisaggMode,
    DiscoveredMode,
    GroupsMode,
    HandoffMode,
    LocalMode,
    PipelineMode,
    ReplicasMode,
    TensorMode,
    engine_mode,
)

PIPE = PipelineOptions(stages=(PipelineStage("s0", "127.0.0.1:9", 0, (0, 2)),),
                       coordinator="127.0.0.1:8", model_identity="ab" * 32, cluster="c")
PIPE2 = PipelineOptions(stages=(PipelineStage("s1", "127.0.0.2:9", 0, (0, 2)),),
                        coordinator="127.0.0.1:8", model_identity="ab" * 32, cluster="c")
LISTED = ReplicasOptions(agents=("127.0.0.2:1",), origin="127.0.0.1:1", cluster="c")
FOUND = ReplicasOptions(agents=(), origin="127.0.0.1:1", cluster="c", discover=True)
DISAGG = ReplicasOptions(agents=(), origin="127.0.0.1:1", cluster="c",
                         prefill_agents=("127.0.0.3:1",), decode_agents=("127.0.0.4:1",))
HANDOFF = HandoffOptions(role="prefill", origin="127.0.0.1:1")
SERVING = ServingOptions("127.0.0.1:0", "n", "c")
RING = ("127.0.0.1:1", "127.0.0.1:2")


def options(**where: Any) -> RouterOptions:
    return RouterOptions(model="/m", model_name="m", host="127.0.0.1", port=1, max_batch=1,
                         max_queued=1, **where)


@pytest.mark.parametrize(("where", "mode"), [
    ({}, LocalMode()),
    ({"tp_size": 2, "tp_hosts": RING}, TensorMode(2, RING)),
    ({"pipeline": PIPE}, PipelineMode(PIPE)),
    ({"pipeline": PIPE, "replica_pipelines": (PIPE2,)}, GroupsMode((PIPE, PIPE2))),
    ({"replicas": LISTED}, ReplicasMode(LISTED)),
    ({"replicas": FOUND}, DiscoveredMode(FOUND)),
    ({"replicas": DISAGG}, DisaggMode(DISAGG)),
    ({"handoff": HANDOFF, "serving": SERVING}, HandoffMode(HANDOFF)),
], ids=["local", "tensor", "pipeline", "groups", "replicas", "discovered", "disagg",
        "handoff"])
def test_each_mode_from_its_options(where: dict[str, Any], mode: object) -> None:
    assert engine_mode(options(**where)) == mode


def test_tensor_parallelism_is_refused_over_a_pipeline_and_without_its_ring() -> None:
    with pytest.raises(ConfigError, match=r"options\.pipeline must be null"):
        engine_mode(options(pipeline=PIPE, tp_size=2, tp_hosts=RING))
    with pytest.raises(ConfigError, match="names 0 ring addresses for tp_size 2"):
        engine_mode(options(tp_size=2))
