"""A good stage offer and the peer it suits, for the offer judge's tests: each test changes
one thing and looks for the refusal that names it."""

from __future__ import annotations

import textwrap
from pathlib import Path

from mlxceld.cluster.assignment.offers import (
    ASSIGNMENT_VERSION,
    Offer,
    PeerFacts,
    Refusal,
    judge,
)
from mlxceld.cluster.clusterfile.load import ClusterConfig
from mlxceld.wire.address import parse_address

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
               agent_host="127.0.0.3", ports=frozenset({19101, 19102}),
               model_family="qwen3")
BOUND = "127.0.0.1:19000"  # the identity the handshake bound


def verdict(offer: Offer = OFFER, me: PeerFacts = ME, bound: str = BOUND,
            newest: int = 4) -> ClusterConfig | Refusal:
    """The judge's answer to ``offer`` (by default OFFER, to ME, over a handshake that bound
    BOUND, plan 4 the newest seen): the cluster to run, or the refusal."""
    return judge(offer, me, bound_identity=parse_address(bound), newest_epoch=newest,
                 toml_path=Path("/tmp/offered.toml"))
