"""A peer judges a stage offer in the documented order; each refusal named."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from mlxceld.cluster.offers import ASSIGNMENT_VERSION, Offer, PeerFacts, Refusal, judge, parse_offer
from mlxceld.cluster.topology import ClusterConfig

TOML = textwrap.dedent("""
    [cluster]
    name = "c1"
    pipeline_parallel_size = 2
    model = "m"

    [[nodes]]
    id = "coordinator"
    address = "127.0.0.1:19000"
    role = "coordinator"

    [[nodes]]
    id = "stage-0"
    address = "127.0.0.2:19100"
    role = "pipeline_stage"
    rank = 0
    layers = [0, 3]

    [[nodes]]
    id = "stage-1"
    address = "127.0.0.3:19101"
    role = "pipeline_stage"
    rank = 1
    layers = [3, 4]
    """)

OFFER = Offer(epoch=5, assignment_version=ASSIGNMENT_VERSION, package_version="1.0",
              cluster="c1", model_identity="ab" * 32, stage=1, layers=(3, 4),
              node_id="stage-1", port=19101, coordinator="127.0.0.1:19000", toml=TOML)
ME = PeerFacts(package_version="1.0", cluster="c1", model_identity="ab" * 32, num_layers=4,
               agent_host="127.0.0.3", ports=frozenset({19101, 19102}))
BOUND = "127.0.0.1:19000"


def verdict(offer: Offer = OFFER, me: PeerFacts = ME, bound: str = BOUND,
            newest: int = 4) -> ClusterConfig | Refusal:
    return judge(offer, me, bound_identity=bound, newest_epoch=newest,
                 toml_path=Path("/tmp/offered.toml"))


def test_a_good_offer_gives_the_cluster_to_run() -> None:
    cfg = verdict()
    assert isinstance(cfg, ClusterConfig) and cfg.stages[1].layers == (3, 4)
    assert parse_offer(OFFER.header()) == OFFER


@pytest.mark.parametrize(("change", "me_change", "bound", "code", "final"), [
    ({"epoch": 4}, {}, BOUND, "stale_epoch", False),
    ({"assignment_version": 1}, {}, BOUND, "assignment_version", True),
    ({"package_version": "0.9"}, {}, BOUND, "package_version", True),
    ({"cluster": "other"}, {}, BOUND, "cluster_name", False),
    ({"model_identity": "cd" * 32}, {}, BOUND, "model", True),
    ({"toml": "[cluster"}, {}, BOUND, "cluster_toml", False),
    ({}, {"num_layers": 6}, BOUND, "layer_range", True),
    ({"layers": (2, 4)}, {}, BOUND, "layer_range", True),
    ({"node_id": "stage-7"}, {}, BOUND, "node_id", False),
    ({"port": 19102}, {}, BOUND, "listener", False),
    ({}, {"agent_host": "127.0.0.9"}, BOUND, "listener", False),
    ({}, {}, "127.0.0.7:19000", "coordinator", False),
])
def test_each_refusal(change: dict[str, object], me_change: dict[str, object], bound: str,
                      code: str, final: bool) -> None:
    got = verdict(dataclasses.replace(OFFER, **change),  # type: ignore[arg-type]
                  dataclasses.replace(ME, **me_change),  # type: ignore[arg-type]
                  bound)
    assert isinstance(got, Refusal) and (got.code, got.final) == (code, final), got
    assert got.reason


def test_the_checks_run_in_order() -> None:
    # A wrong package version and a wrong model: the version is named (it comes first).
    got = verdict(dataclasses.replace(OFFER, package_version="0.9", model_identity="cd" * 32))
    assert isinstance(got, Refusal) and got.code == "package_version"


def test_parse_offer_names_the_bad_field() -> None:
    bad = OFFER.header() | {"stage": "one"}
    with pytest.raises(ValueError, match="'stage'"):
        parse_offer(bad)
    with pytest.raises(ValueError, match="'layers'"):
        parse_offer(OFFER.header() | {"layers": [1]})
