"""A peer judges a stage offer in the documented order; each refusal named."""

from __future__ import annotations

import dataclasses

import pytest

from mlxceld.cluster.assignment.offers import Refusal
from mlxceld.cluster.clusterfile.load import ClusterConfig
from mlxceld.models.families import SUPPORTED
from mlxceld.wire.assignment_messages import Offer

from helpers.offers import BOUND, ME, OFFER, TOML, verdict


def test_a_good_offer_gives_the_cluster_to_run() -> None:
    cfg = verdict()
    assert isinstance(cfg, ClusterConfig) and cfg.stages[1].layers == (3, 4)
    assert Offer.from_wire(OFFER.to_wire()) == OFFER


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
    ({"toml": TOML.replace("127.0.0.3:19101", "192.0.2.1:19101")}, {"agent_host": "0.0.0.0"},
     BOUND, "listener", False),  # a wildcard peer: an address that is not this host's
    ({"toml": TOML.replace("127.0.0.3:19101", "no-such-host.invalid:19101")}, {}, BOUND,
     "listener", False),
    ({}, {}, "127.0.0.7:19000", "coordinator", False),
    ({}, {"model_family": "mamba"}, BOUND, "model_family", True),
    ({}, {"model_family": None}, BOUND, "model_family", True),
])
def test_each_refusal(change: dict[str, object], me_change: dict[str, object], bound: str,
                      code: str, final: bool) -> None:
    got = verdict(dataclasses.replace(OFFER, **change),  # type: ignore[arg-type]
                  dataclasses.replace(ME, **me_change),  # type: ignore[arg-type]
                  bound)
    assert isinstance(got, Refusal) and (got.code, got.final) == (code, final), got
    assert got.reason


@pytest.mark.parametrize(("stage_address", "agent_host", "coordinator", "bound"), [
    # An agent on a wildcard takes a stage on any of its own addresses.
    ("127.0.0.3:19101", "0.0.0.0", "127.0.0.1:19000", BOUND),
    ("127.0.0.5:19101", "0.0.0.0", "127.0.0.1:19000", BOUND),
    ("127.0.0.5:19101", "::", "127.0.0.1:19000", BOUND),
    # Host names, in the TOML and for the agent, are their addresses.
    ("localhost:19101", "127.0.0.1", "localhost:19000", BOUND),
    ("127.0.0.1:19101", "localhost", "127.0.0.1:19000", BOUND),
    ("localhost:19101", "0.0.0.0", "localhost:19000", BOUND),
    # A coordinator on a wildcard: the peer knows it by where it came from.
    ("127.0.0.3:19101", "127.0.0.3", "0.0.0.0:19000", "127.0.0.8:19000"),
])
def test_wildcards_and_host_names(stage_address: str, agent_host: str, coordinator: str,
                                  bound: str) -> None:
    toml = TOML.replace("127.0.0.3:19101", stage_address).replace("127.0.0.1:19000",
                                                                   coordinator)
    offer = dataclasses.replace(OFFER, toml=toml, coordinator=coordinator)
    got = verdict(offer, dataclasses.replace(ME, agent_host=agent_host), bound)
    assert isinstance(got, ClusterConfig), got


def test_the_checks_run_in_order() -> None:
    # A wrong package version and a wrong model: the version is named (it comes first).
    got = verdict(dataclasses.replace(OFFER, package_version="0.9", model_identity="cd" * 32))
    assert isinstance(got, Refusal) and got.code == "package_version"


def test_a_family_not_split_is_refused_naming_it_and_the_supported_ones() -> None:
    got = verdict(OFFER, dataclasses.replace(ME, model_family="mamba"))
    assert isinstance(got, Refusal) and got.code == "model_family" and got.final, got
    assert "'mamba'" in got.reason and all(f in got.reason for f in SUPPORTED), got


def test_an_offer_from_the_wire_names_the_bad_field() -> None:
    bad = OFFER.to_wire() | {"stage": "one"}
    with pytest.raises(ValueError, match="'stage'"):
        Offer.from_wire(bad)
    with pytest.raises(ValueError, match="'layers'"):
        Offer.from_wire(OFFER.to_wire() | {"layers": [1]})
