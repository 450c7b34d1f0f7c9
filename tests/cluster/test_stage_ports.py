"""``stage_ports``: parsed strictly, proposed from by the inventory, enforced by the offer
judge; a range with no free port leaves the peer out of a plan, saying why."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from mlxceld.cluster.assignment.offers import Refusal
from mlxceld.cluster.clusterfile.load import ClusterConfig
from mlxceld.cluster.plan.candidates import plan_nodes
from mlxceld.config.stage_ports import StagePorts, parse_stage_ports
from mlxceld.discovery.inventory import free_ports
from mlxceld.errors import ConfigError
from mlxceld.state.peers import PeerRow

from helpers.offers import ME, OFFER, verdict


@pytest.mark.parametrize(("value", "expected"), [
    ("19100-19199", StagePorts(19100, 19199)), (19100, StagePorts(19100, 19100)),
    ("19100", StagePorts(19100, 19100)), (" 1-65535 ", StagePorts(1, 65535)),
    ("7-7", StagePorts(7, 7)),
])
def test_a_port_or_an_inclusive_range(value: object, expected: StagePorts) -> None:
    ports = parse_stage_ports(value, "--stage-ports")
    assert ports == expected
    assert ports.first in ports and ports.last in ports and ports.last + 1 not in ports
    assert len(list(ports)) == len(ports) == ports.last - ports.first + 1


@pytest.mark.parametrize(("value", "words"), [
    ("19199-19100", "starts above its end (19199 > 19100)"), ("0-10", "port 0 is outside"),
    ("65530-65536", "port 65536 is outside"), ("19100-", "not a port or a range"),
    ("abc", "not a port or a range"), ("1-2-3", "not a port or a range"),
    (True, "not a port or a range"), (19.5, "not a port or a range"),
    ("-5", "not a port or a range"), ("", "not a port or a range"),
])
def test_a_bad_value_names_the_key(value: object, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_stage_ports(value, "mlxceld.toml: 'daemon.stage_ports'")
    assert err.value.message.startswith("mlxceld.toml: 'daemon.stage_ports': ")
    assert words in err.value.message and "19100-19199" in err.value.hint


def test_the_inventory_proposes_the_lowest_free_ports_of_the_range() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        assert free_ports("127.0.0.1", 3, StagePorts(port, port)) == []  # a full range
        ports = free_ports("127.0.0.1", 3, StagePorts(port - 2, port + 3))
    assert port not in ports and len(ports) == 3
    assert all(port - 2 <= p <= port + 3 for p in ports) and ports == sorted(ports)
    assert free_ports("127.0.0.1", 3, StagePorts(port, port)) == [port]  # free again


def test_the_judge_refuses_a_port_outside_the_range() -> None:
    inside = dataclasses.replace(ME, stage_ports=StagePorts(19100, 19101))
    assert isinstance(verdict(me=inside), ClusterConfig)
    outside = dataclasses.replace(ME, stage_ports=StagePorts(19200, 19299))
    refusal = verdict(me=outside)
    assert isinstance(refusal, Refusal) and refusal.code == "stage_port" and not refusal.final
    assert refusal.reason == (f"the offer places stage 1 at port {OFFER.port}, outside this "
                              "node's stage_ports 19200-19299")


def peer(address: str, ports: list[int]) -> PeerRow:
    return PeerRow(address=address, source="static", state="reachable", updated_at=1.0,
                   node_id="n", memory_total=8 << 30, memory_available=4 << 30,
                   inventory={"ports": ports, "model": None})


def test_a_peer_with_no_free_stage_port_is_left_out_and_named() -> None:
    nodes, notes = plan_nodes([peer("127.0.0.2:19000", [19100]),
                               peer("127.0.0.3:19000", [])], "ab" * 32)
    assert [n.address for n in nodes] == ["127.0.0.2:19000"]
    assert notes == ["n (127.0.0.3:19000) proposed no free stage port (with stage_ports set: "
                     "every port of that range is taken there): left out"]
