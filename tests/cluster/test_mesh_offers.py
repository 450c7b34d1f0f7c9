"""A 2D mesh's offers (``Offer.tp_rank``, ``tp_group``): on the wire, judged by each rank
(offers.py), and the node a peer runs for it (``offered_node``)."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from mlxceld.cluster.assignment.offers import Refusal, offered_node
from mlxceld.cluster.clusterfile.load import ClusterConfig
from mlxceld.wire.assignment_messages import Offer
from mlxceld.wire.messages import MessageError

from helpers.offers import ME, OFFER, TOML, verdict

MESH = textwrap.dedent("""
    [cluster]
    name = "c1"
    pipeline_parallel_size = 2
    tensor_parallel_size = 2
    model = "m"

    [[nodes]]
    id = "coordinator"
    address = "127.0.0.1:19000"
    role = "coordinator"

    [[nodes]]
    id = "stage-0"
    address = "127.0.0.2:19100"
    role = "pipeline_tensor_parallel"
    layers = [0, 3]
    rank = 0

    [[nodes]]
    id = "stage-0-tp-1"
    address = "127.0.0.4:19000"
    role = "pipeline_tensor_parallel"
    layers = [0, 3]
    rank = 1

    [[nodes]]
    id = "stage-1"
    address = "127.0.0.3:19101"
    role = "pipeline_tensor_parallel"
    layers = [3, 4]
    rank = 0

    [[nodes]]
    id = "stage-1-tp-1"
    address = "127.0.0.5:19000"
    role = "pipeline_tensor_parallel"
    layers = [3, 4]
    rank = 1
    """)
GROUP = ("127.0.0.3:19000", "127.0.0.5:19000")  # stage 1's ranks' agents
ZERO = dataclasses.replace(OFFER, toml=MESH, tp_rank=0, tp_group=GROUP)
ONE = dataclasses.replace(ZERO, tp_rank=1, node_id="stage-1-tp-1", port=0)
AT_FIVE = dataclasses.replace(ME, agent_host="127.0.0.5")


def test_the_group_goes_on_the_wire_only_with_a_group() -> None:
    assert "tp_group" not in OFFER.to_wire() and "tp_rank" not in OFFER.to_wire()
    header = ONE.to_wire()
    assert (header["tp_rank"], header["tp_group"]) == (1, list(GROUP))
    assert Offer.from_wire(header) == ONE
    assert Offer.from_wire(OFFER.to_wire()) == OFFER


@pytest.mark.parametrize(("change", "field"), [
    ({"tp_group": ["127.0.0.3:19000"]}, "tp_group"),
    ({"tp_group": "127.0.0.3:19000"}, "tp_group"),
    ({"tp_group": ["a:1"] * 17}, "tp_group"),
    ({"tp_group": ["127.0.0.3:19000", 5]}, "tp_group"),
    ({"tp_rank": 2}, "tp_rank"),
    ({"tp_rank": -1}, "tp_rank"),
    ({"tp_rank": None}, "tp_rank"),
    ({"tp_rank": "1"}, "tp_rank"),
])
def test_a_bad_group_is_refused_naming_its_field(change: dict[str, object],
                                                 field: str) -> None:
    with pytest.raises(MessageError) as err:
        Offer.from_wire({**ONE.to_wire(), **change})
    assert err.value.field == field


def test_each_rank_of_a_mesh_stage_takes_its_offer() -> None:
    zero = verdict(ZERO)
    assert isinstance(zero, ClusterConfig) and zero.mesh
    one = verdict(ONE, AT_FIVE)
    assert isinstance(one, ClusterConfig) and one.mesh
    assert offered_node(1, MESH, "127.0.0.5:19000") == "stage-1-tp-1"
    assert offered_node(1, MESH, "127.0.0.3:19000") == "stage-1"
    assert offered_node(0, MESH, "127.0.0.4:19000") == "stage-0-tp-1"
    assert offered_node(1, TOML, "127.0.0.5:19000") == "stage-1"  # no mesh: the stage


@pytest.mark.parametrize(("offer", "me", "code"), [
    (dataclasses.replace(OFFER, toml=MESH), ME, "tensor_group"),  # a mesh without a group
    (dataclasses.replace(OFFER, tp_group=GROUP), ME, "tensor_group"),  # a group, no mesh
    (dataclasses.replace(ZERO, tp_group=("127.0.0.3:19000", "127.0.0.4:19000")), ME,
     "tensor_group"),  # another stage's rank
    (dataclasses.replace(ZERO, tp_group=("127.0.0.9:19000", "127.0.0.5:19000")), ME,
     "tensor_group"),  # rank 0 not on its stage's host
    (dataclasses.replace(ZERO, tp_group=(*GROUP, "127.0.0.6:19000")), ME, "tensor_group"),
    (dataclasses.replace(ONE, node_id="stage-1"), AT_FIVE, "node_id"),
    (dataclasses.replace(ONE, node_id="stage-0-tp-1"), AT_FIVE, "node_id"),
    (ONE, ME, "listener"),  # rank 1's agent is .5, this peer .3
    (dataclasses.replace(ONE, coordinator="127.0.0.7:19000"), AT_FIVE, "coordinator"),
])
def test_a_rank_refuses_an_offer_that_is_not_its_own(offer: Offer, me: object,
                                                     code: str) -> None:
    got = verdict(offer, me)  # type: ignore[arg-type]
    assert isinstance(got, Refusal) and got.code == code and not got.final, got
    assert got.reason
